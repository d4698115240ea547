// Read-only memory mapping of a whole file. The mapping is the one owner of the bytes;
// tensors loaded from it point into it (no copies for the CPU backend).
#ifndef ATOMC_COMMON_MAPPED_FILE_H
#define ATOMC_COMMON_MAPPED_FILE_H

#include <stddef.h>

#include "common/error.h"

struct mapped_file {
    char *path;        // owned copy of the path, for error messages
    const unsigned char *data;
    size_t size;
};

atomc_status mapped_file_open(struct mapped_file *f, const char *path, struct error *err);
void mapped_file_close(struct mapped_file *f);

// Reads a whole (small) file into a NUL-terminated malloc'd buffer. *len may be NULL.
atomc_status file_read_all(const char *path, char **out, size_t *len, struct error *err);
int file_exists(const char *path);
int dir_exists(const char *path);

#endif
