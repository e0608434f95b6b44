/* The one setting of an LD_PRELOAD shim (tests/integration/shims.py): a signed integer in the
 * file named by an environment variable, read again at most every 20 ms of monotonic time so
 * that a test can change it for a running process. A missing or unreadable file reads as 0.
 * The caller passes the monotonic time: a shim that wraps clock_gettime reads it unshifted. */
#ifndef MQSTORE_SHIM_SETTING_H
#define MQSTORE_SHIM_SETTING_H

#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#define SHIM_REREAD_NS 20000000LL

struct shim_setting {
    const char *env;                 /* the environment variable naming the file */
    _Atomic long long value;
    _Atomic long long next_read_ns;  /* initialise to -1: read on first use */
};

static long long shim_setting_get(struct shim_setting *s, long long now_ns) {
    if (now_ns < atomic_load(&s->next_read_ns))
        return atomic_load(&s->value);
    atomic_store(&s->next_read_ns, now_ns + SHIM_REREAD_NS);
    const char *path = getenv(s->env);
    long long value = 0;
    if (path) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            char buf[32];
            ssize_t n = read(fd, buf, sizeof buf - 1);
            close(fd);
            if (n > 0) {
                buf[n] = 0;
                value = strtoll(buf, NULL, 10);
            }
        }
    }
    atomic_store(&s->value, value);
    return value;
}

#endif
