// Chrome-trace recording: spans nest, disabled tracing records nothing, output is valid JSON.
#include <jansson.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/trace.h"
#include "test.h"

TEST(trace_records_only_when_enabled_and_writes_chrome_json) {
    struct trace *t = trace_create(16);
    trace_begin(t, "ignored");
    trace_end(t, "ignored");
    trace_start(t);
    trace_begin(t, "step");
    trace_begin(t, "forward \"q\"");
    trace_end(t, "forward \"q\"");
    trace_counter(t, "num_running", 7);
    trace_end(t, "step");
    trace_stop(t);
    trace_begin(t, "after");
    char path[] = "/tmp/atomc_trace_XXXXXX";
    int fd = mkstemp(path);
    ASSERT_TRUE(fd >= 0);
    close(fd);
    size_t n = 0;
    ASSERT_OK(trace_write_json(t, path, &n, NULL));
    ASSERT_EQ(n, 5);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    unlink(path);
    ASSERT_TRUE(j != NULL);
    json_t *ev = json_object_get(j, "traceEvents");
    ASSERT_EQ(json_array_size(ev), 5);
    ASSERT_STREQ(json_string_value(json_object_get(json_array_get(ev, 0), "name")), "step");
    ASSERT_STREQ(json_string_value(json_object_get(json_array_get(ev, 1), "name")), "forward \"q\"");
    ASSERT_STREQ(json_string_value(json_object_get(json_array_get(ev, 4), "ph")), "E");
    double t0 = json_number_value(json_object_get(json_array_get(ev, 0), "ts"));
    double t4 = json_number_value(json_object_get(json_array_get(ev, 4), "ts"));
    ASSERT_TRUE(t4 >= t0);
    ASSERT_NEAR(json_number_value(json_object_get(json_object_get(json_array_get(ev, 3), "args"), "num_running")), 7, 0);
    json_decref(j);
    trace_free(t);
}

TEST(trace_bounds_its_buffer) {
    struct trace *t = trace_create(4);
    trace_start(t);
    for (int i = 0; i < 10; i++) trace_counter(t, "c", i);
    char path[] = "/tmp/atomc_trace_XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    size_t n = 0;
    ASSERT_OK(trace_write_json(t, path, &n, NULL));
    ASSERT_EQ(n, 4);
    json_t *j = json_load_file(path, 0, NULL);
    unlink(path);
    ASSERT_EQ(json_integer_value(json_object_get(json_object_get(j, "otherData"), "dropped_events")), 6);
    json_decref(j);
    trace_free(t);
}

int main(int argc, char **argv) { return test_main(argc, argv); }
