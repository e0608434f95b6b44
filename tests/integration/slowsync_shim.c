/* A slow disk for one process, as a contended or throttled volume makes it: every fsync and
 * fdatasync first waits the number of milliseconds in the file named by
 * MQSTORE_SLOWSYNC_FILE (read again at most every 20 ms of monotonic time), then syncs.
 * Writes and reads are left alone: only the wait for durability grows, which is what a busy
 * disk's queue does to a sync. A missing or unreadable file means no wait.
 *
 * Built by tests/integration/shims.py: cc -shared -fPIC -O2 -o slowsync_shim.so slowsync_shim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <time.h>

#include "shim_setting.h"

typedef int (*sync_fn)(int);

static struct shim_setting delay = {"MQSTORE_SLOWSYNC_FILE", 0, -1};

static long long current_delay_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return shim_setting_get(&delay, (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
}

static void wait_first(void) {
    long long ms = current_delay_ms();
    if (ms <= 0)
        return;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    int saved = errno;
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
    errno = saved;
}

static int slowed(const char *name, sync_fn *real, int fd) {
    if (!*real)
        *real = (sync_fn)dlsym(RTLD_NEXT, name);
    wait_first();
    return (*real)(fd);
}

int fsync(int fd) {
    static sync_fn real;
    return slowed("fsync", &real, fd);
}

int fdatasync(int fd) {
    static sync_fn real;
    return slowed("fdatasync", &real, fd);
}
