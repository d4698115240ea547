#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int log_threshold(void) {
    // Read once per call is cheap enough for logging and keeps no hidden mutable global.
    const char *s = getenv("ATOMC_LOG");
    if (!s) return LOG_LEVEL_INFO;
    if (!strcmp(s, "error")) return LOG_LEVEL_ERROR;
    if (!strcmp(s, "warn")) return LOG_LEVEL_WARN;
    if (!strcmp(s, "debug")) return LOG_LEVEL_DEBUG;
    return LOG_LEVEL_INFO;
}

int log_enabled(enum log_level level) { return (int)level <= log_threshold(); }

void log_write(enum log_level level, const char *file, int line, const char *fmt, ...) {
    if (!log_enabled(level)) return;
    static const char *names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    localtime_r(&ts.tv_sec, &tm);
    const char *base = strrchr(file, '/');
    fprintf(stderr, "%s %02d:%02d:%02d.%03ld %s:%d] %s\n", names[level], tm.tm_hour, tm.tm_min, tm.tm_sec,
            ts.tv_nsec / 1000000, base ? base + 1 : file, line, msg);
}
