/* A wall-clock step for one process, as an NTP step or an operator's `date -s` would make it.
 *
 * Loaded with LD_PRELOAD. The process's CLOCK_REALTIME (clock_gettime, gettimeofday, time)
 * is shifted by the signed number of nanoseconds in the file named by MQSTORE_WALLCLOCK_FILE,
 * read again at most every 20 ms of monotonic time; the monotonic and boot clocks are left
 * alone, as a real step leaves them. A missing or unreadable file means no shift.
 *
 * Built by tests/integration/shims.py: cc -shared -fPIC -O2 -o wallclock_shim.so wallclock_shim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/time.h>
#include <time.h>

#include "shim_setting.h"

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static clock_gettime_fn real_clock_gettime;
static struct shim_setting offset = {"MQSTORE_WALLCLOCK_FILE", 0, -1};

static void init(void) {
    if (!real_clock_gettime)
        real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
}

static long long current_offset(void) {
    struct timespec ts;
    real_clock_gettime(CLOCK_MONOTONIC, &ts);
    return shim_setting_get(&offset, (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
}

static void shift(struct timespec *ts) {
    long long t = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + current_offset();
    ts->tv_sec = t / 1000000000LL;
    ts->tv_nsec = t % 1000000000LL;
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += 1000000000LL;
        ts->tv_sec -= 1;
    }
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    init();
    int rc = real_clock_gettime(clk, ts);
    if (rc == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE))
        shift(ts);
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    (void)tz;
    struct timespec ts;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    if (rc == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
