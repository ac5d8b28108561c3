/*
 * simnvml: a simulated NVIDIA Management Library (libnvidia-ml.so.1) for tests.
 *
 * Loaded by the real nvidia-ml-py (pynvml) instead of NVIDIA's driver library.
 * The "hardware" is a plain-text state file of key=value lines (later lines
 * override earlier ones), re-read at every nvmlInit*, so a test can change the
 * GPUs between two inits and inject faults (errors, hangs, lost GPUs).
 * See docs/testing-simulated-gpus.md for the state file reference.
 *
 * Build: cc -O2 -shared -fPIC -Wall -Werror -Wl,-soname,libnvidia-ml.so.1 \
 *           [-DSIMNVML_DEFAULT_STATE='"/dir/%n.state"'] -o libnvidia-ml.so.1 simnvml.c -lpthread
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- NVML ABI subset (layouts as in nvml.h / pynvml) ------------------------------- */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_NVLINK_MAX_LINKS 36
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu
#define NVML_VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFull
#define NVML_MEMORY_V2_VERSION 0x02000028u
#define NVML_TEMPERATURE_V1_VERSION 0x0100000Cu

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct { unsigned int version; int sensorType; int temperature; } nvmlTemperature_v1_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    unsigned int gpuUtilization, memoryUtilization;
    unsigned long long maxMemoryUsage, time, startTime;
    unsigned int isRunning;
    unsigned int reserved[5];
} nvmlAccountingStats_t;

/* Handles are pointers into these static arrays, so they stay valid across re-inits and a
 * handle whose GPU vanished from the state file is recognised (INVALID_ARGUMENT). */
#define MAX_GPUS 64
#define MAX_MIG 8
struct simdev { int gpu; int mig; /* -1: the physical GPU */ };
typedef struct simdev *nvmlDevice_t;
static struct simdev g_dev[MAX_GPUS];
static struct simdev g_migdev[MAX_GPUS][MAX_MIG];

/* ---- key/value store ---------------------------------------------------------------- */

typedef struct { char *k, *v; } ent_t;
typedef struct { ent_t *t; size_t cap, n; } store_t;

static uint64_t hash_str(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) { h ^= (unsigned char)s[i]; h *= 1099511628211ull; }
    return h;
}

static store_t *st_new(void) {
    store_t *s = calloc(1, sizeof *s);
    if (!s) abort();
    s->cap = 256;
    s->t = calloc(s->cap, sizeof(ent_t));
    if (!s->t) abort();
    return s;
}

static void st_free(store_t *s) {
    if (!s) return;
    for (size_t i = 0; i < s->cap; i++) { free(s->t[i].k); free(s->t[i].v); }
    free(s->t);
    free(s);
}

static ent_t *st_slot(store_t *s, const char *k, size_t klen) {
    size_t i = hash_str(k, klen) & (s->cap - 1);
    while (s->t[i].k && !(strlen(s->t[i].k) == klen && memcmp(s->t[i].k, k, klen) == 0))
        i = (i + 1) & (s->cap - 1);
    return &s->t[i];
}

static void st_put(store_t *s, const char *k, size_t klen, const char *v, size_t vlen) {
    if ((s->n + 1) * 2 > s->cap) {
        store_t old = *s;
        s->cap *= 2;
        s->n = 0;
        s->t = calloc(s->cap, sizeof(ent_t));
        if (!s->t) abort();
        for (size_t i = 0; i < old.cap; i++)
            if (old.t[i].k) { *st_slot(s, old.t[i].k, strlen(old.t[i].k)) = old.t[i]; s->n++; }
        free(old.t);
    }
    ent_t *e = st_slot(s, k, klen);
    if (!e->k) { e->k = strndup(k, klen); s->n++; }
    free(e->v);
    e->v = strndup(v, vlen);
    if (!e->k || !e->v) abort();
}

static const char *st_get(const store_t *s, const char *k) {
    if (!s) return NULL;
    ent_t *e = st_slot((store_t *)s, k, strlen(k));
    return e->k ? e->v : NULL;
}

/* Parse "key=value" lines; '#' starts a comment line; later lines override earlier ones. */
static void st_parse(store_t *s, const char *buf, size_t len) {
    const char *p = buf, *end = buf + len;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        const char *a = p, *b = le;
        while (a < b && (*a == ' ' || *a == '\t')) a++;
        while (b > a && (b[-1] == '\r' || b[-1] == ' ' || b[-1] == '\t')) b--;
        const char *eq = memchr(a, '=', (size_t)(b - a));
        if (a < b && *a != '#' && eq) {
            const char *ke = eq, *vs = eq + 1;
            while (ke > a && (ke[-1] == ' ' || ke[-1] == '\t')) ke--;
            while (vs < b && (*vs == ' ' || *vs == '\t')) vs++;
            if (ke > a) st_put(s, a, (size_t)(ke - a), vs, (size_t)(b - vs));
        }
        p = nl ? nl + 1 : end;
    }
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 8192, n = 0;
    char *buf = malloc(cap);
    size_t r;
    while (buf && (r = fread(buf + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap) { cap *= 2; buf = realloc(buf, cap); }
    }
    fclose(f);
    if (!buf) return NULL;
    *len = n;
    return buf;
}

static store_t *st_load(const char *path) {
    size_t len = 0;
    char *buf = read_file(path, &len);
    if (!buf) return NULL;
    store_t *s = st_new();
    st_parse(s, buf, len);
    free(buf);
    return s;
}

/* ---- global state -------------------------------------------------------------------- */

static pthread_rwlock_t g_lock = PTHREAD_RWLOCK_INITIALIZER;
static store_t *g_store;
static int g_refs; /* nvmlInit minus nvmlShutdown calls */
static char g_state_path[4096];
static char g_action_path[4096 + 16];

/* Every lookup copies its value out under the read lock, so a call may sleep (hang
 * injection) without holding the lock and a concurrent re-init can replace the store. */
static int kv_vget(char *out, size_t n, const char *fmt, va_list ap) {
    char key[512];
    vsnprintf(key, sizeof key, fmt, ap);
    pthread_rwlock_rdlock(&g_lock);
    const char *v = st_get(g_store, key);
    if (v && out && n) snprintf(out, n, "%s", v);
    pthread_rwlock_unlock(&g_lock);
    return v != NULL;
}

static int kv_str(char *out, size_t n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int r = kv_vget(out, n, fmt, ap);
    va_end(ap);
    return r;
}

static char *kv_dup(const char *fmt, ...) {
    char key[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(key, sizeof key, fmt, ap);
    va_end(ap);
    pthread_rwlock_rdlock(&g_lock);
    const char *v = st_get(g_store, key);
    char *r = v ? strdup(v) : NULL;
    pthread_rwlock_unlock(&g_lock);
    return r;
}

/* Integers: decimal, or hex with 0x (a leading 0 is NOT octal). */
static int parse_ll(const char *s, long long *out) {
    char *e;
    errno = 0;
    while (*s == ' ') s++;
    long long v;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) v = (long long)strtoull(s + 2, &e, 16);
    else if (s[0] == '-') v = strtoll(s, &e, 10);
    else v = (long long)strtoull(s, &e, 10);
    if (e == s || errno) return 0;
    while (*e == ' ') e++;
    if (*e) return 0;
    *out = v;
    return 1;
}

static long long kv_int(long long def, const char *fmt, ...) {
    char buf[128];
    va_list ap;
    va_start(ap, fmt);
    int found = kv_vget(buf, sizeof buf, fmt, ap);
    va_end(ap);
    long long v;
    return found && parse_ll(buf, &v) ? v : def;
}

static double kv_dbl(double def, const char *fmt, ...) {
    char buf[128];
    va_list ap;
    va_start(ap, fmt);
    int found = kv_vget(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (!found) return def;
    char *e;
    double v = strtod(buf, &e);
    return e == buf ? def : v;
}

static int initialized(void) {
    pthread_rwlock_rdlock(&g_lock);
    int r = g_refs > 0;
    pthread_rwlock_unlock(&g_lock);
    return r;
}

static void sleep_s(double s) {
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

/* "nvmlDeviceGetPciInfo_v3" -> "nvmlDeviceGetPciInfo" so either name works in keys. */
static void base_name(const char *fn, char *out, size_t n) {
    snprintf(out, n, "%s", fn);
    char *u = strrchr(out, '_');
    if (u && u[1] == 'v' && u[2]) {
        for (char *c = u + 2; *c; c++) if (*c < '0' || *c > '9') return;
        *u = 0;
    }
}

/* ---- per-GPU values with defaults ----------------------------------------------------- */

static int gpu_count(void) {
    long long n = kv_int(0, "gpu_count");
    if (n < 0) n = 0;
    return n > MAX_GPUS ? MAX_GPUS : (int)n;
}

static void gpu_uuid(int g, char *out, size_t n) {
    if (!kv_str(out, n, "gpu.%d.uuid", g))
        snprintf(out, n, "GPU-5157ba00-0000-4000-8000-%012x", g);
}

static void gpu_name(int g, char *out, size_t n) {
    if (!kv_str(out, n, "gpu.%d.name", g)) snprintf(out, n, "NVIDIA H100 80GB HBM3");
}

/* Parse a bus id "dddddddd:bb:dd.f" (also "dddd:bb:dd.f", "bb:dd.f") into numbers. */
static int parse_bus_id(const char *s, unsigned *dom, unsigned *bus, unsigned *dev, unsigned *fn) {
    unsigned a, b, c, d;
    if (sscanf(s, "%x:%x:%x.%x", &a, &b, &c, &d) == 4) { *dom = a; *bus = b; *dev = c; *fn = d; return 1; }
    if (sscanf(s, "%x:%x.%x", &b, &c, &d) == 3) { *dom = 0; *bus = b; *dev = c; *fn = d; return 1; }
    return 0;
}

static void fill_pci(nvmlPciInfo_t *p, const char *bus_id, unsigned dev_id, unsigned subsys_id) {
    unsigned dom = 0, bus = 0, dv = 0, fn = 0;
    parse_bus_id(bus_id, &dom, &bus, &dv, &fn);
    memset(p, 0, sizeof *p);
    p->domain = dom;
    p->bus = bus;
    p->device = dv;
    p->pciDeviceId = dev_id;
    p->pciSubSystemId = subsys_id;
    /* Real NVML prints bus ids with upper-case hex digits. */
    snprintf(p->busId, sizeof p->busId, "%08X:%02X:%02X.%X", dom, bus, dv, fn);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%04X:%02X:%02X.%X", dom & 0xFFFF, bus, dv, fn);
}

static void gpu_bus_id(int g, char *out, size_t n) {
    if (!kv_str(out, n, "gpu.%d.pci_bus_id", g)) snprintf(out, n, "00000000:%02X:00.0", 0x18 + g * 0x10);
}

/* ---- call prologues: init check, handle check, hang, lost, injected error ------------- */

static nvmlReturn_t injected_error(const char *prefix, const char *fn) {
    char base[128];
    base_name(fn, base, sizeof base);
    long long code;
    if ((code = kv_int(-1, "%serror.%s", prefix, fn)) >= 0) return (nvmlReturn_t)code;
    if ((code = kv_int(-1, "%serror.%s", prefix, base)) >= 0) return (nvmlReturn_t)code;
    return NVML_SUCCESS;
}

static double injected_hang(const char *prefix, const char *fn) {
    char base[128];
    base_name(fn, base, sizeof base);
    double s = kv_dbl(-1, "%shang.%s", prefix, fn);
    return s >= 0 ? s : kv_dbl(0, "%shang.%s", prefix, base);
}

/* Node-level functions (system getters, device count). */
static nvmlReturn_t node_enter(const char *fn) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    sleep_s(injected_hang("", fn));
    return injected_error("", fn);
}

/* Faults of GPU g (and MIG device m >= 0): hang first, then lost, then injected errors. */
static nvmlReturn_t gpu_faults(const char *fn, int g, int m) {
    char pfx[64], mpfx[64];
    snprintf(pfx, sizeof pfx, "gpu.%d.", g);
    snprintf(mpfx, sizeof mpfx, "gpu.%d.mig.%d.", g, m);
    sleep_s(injected_hang("", fn) + kv_dbl(0, "gpu.%d.hang_all", g) + injected_hang(pfx, fn) +
            (m >= 0 ? injected_hang(mpfx, fn) : 0));
    if (kv_int(0, "gpu.%d.lost", g)) return NVML_ERROR_GPU_IS_LOST;
    nvmlReturn_t r;
    if (m >= 0 && (r = injected_error(mpfx, fn))) return r;
    if ((r = injected_error(pfx, fn))) return r;
    return injected_error("", fn);
}

static int mig_valid(int g, int m) {
    return kv_int(0, "gpu.%d.mig_mode", g) == 1 && m < kv_int(0, "gpu.%d.mig_count", g) && m < MAX_MIG;
}

/* Resolve a handle: pointer must be ours and the GPU (MIG device) must still exist. */
static nvmlReturn_t resolve(nvmlDevice_t h, int *g, int *m) {
    uintptr_t p = (uintptr_t)h;
    if (p >= (uintptr_t)&g_dev[0] && p < (uintptr_t)g_dev + sizeof g_dev &&
        (p - (uintptr_t)&g_dev[0]) % sizeof(struct simdev) == 0) {
        *g = h->gpu;
        *m = -1;
    } else if (p >= (uintptr_t)&g_migdev[0][0] && p < (uintptr_t)g_migdev + sizeof g_migdev &&
               (p - (uintptr_t)&g_migdev[0][0]) % sizeof(struct simdev) == 0) {
        *g = h->gpu;
        *m = h->mig;
    } else {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (*g >= gpu_count()) return NVML_ERROR_INVALID_ARGUMENT;
    if (*m >= 0 && !mig_valid(*g, *m)) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

static nvmlReturn_t dev_enter(const char *fn, nvmlDevice_t h, int *g, int *m) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = resolve(h, g, m);
    if (r) return r;
    return gpu_faults(fn, *g, *m);
}

/* Most getters are physical-GPU properties: on a MIG device handle they are not supported. */
#define ENTER_GPU(fn, h, g)                                  \
    int g, m_;                                               \
    do {                                                     \
        nvmlReturn_t r_ = dev_enter(fn, h, &g, &m_);         \
        if (r_) return r_;                                   \
        if (m_ >= 0) return NVML_ERROR_NOT_SUPPORTED;        \
    } while (0)

static nvmlReturn_t copy_str(char *dst, unsigned len, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ---- init / shutdown / errors --------------------------------------------------------- */

static void resolve_state_path(char *out, size_t n) {
    const char *env = getenv("SIMNVML_STATE");
    const char *tmpl = env && *env ? env : NULL;
#ifdef SIMNVML_DEFAULT_STATE
    if (!tmpl) tmpl = SIMNVML_DEFAULT_STATE;
#endif
    if (!tmpl) { out[0] = 0; return; }
    char node[256];
    const char *nn = getenv("SLURMD_NODENAME");
    if (nn && *nn) snprintf(node, sizeof node, "%s", nn);
    else {
        if (gethostname(node, sizeof node) != 0) snprintf(node, sizeof node, "localhost");
        node[sizeof node - 1] = 0;
        char *dot = strchr(node, '.');
        if (dot) *dot = 0;
    }
    size_t o = 0;
    for (const char *p = tmpl; *p && o + 1 < n; p++) {
        if (p[0] == '%' && p[1] == 'n') {
            o += (size_t)snprintf(out + o, n - o, "%s", node);
            if (o >= n) o = n - 1;
            p++;
        } else {
            out[o++] = *p;
        }
    }
    out[o] = 0;
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    char path[4096];
    resolve_state_path(path, sizeof path);
    store_t *s = path[0] ? st_load(path) : NULL;
    if (!s) return NVML_ERROR_DRIVER_NOT_LOADED;
    const char *h = st_get(s, "init_hang_s");
    if (h) sleep_s(strtod(h, NULL));
    long long code = 0;
    const char *e = st_get(s, "init_error");
    if (e && parse_ll(e, &code) && code != 0) { st_free(s); return (nvmlReturn_t)code; }
    pthread_rwlock_wrlock(&g_lock);
    for (int i = 0; i < MAX_GPUS; i++) {
        g_dev[i].gpu = i;
        g_dev[i].mig = -1;
        for (int k = 0; k < MAX_MIG; k++) { g_migdev[i][k].gpu = i; g_migdev[i][k].mig = k; }
    }
    st_free(g_store);
    g_store = s;
    snprintf(g_state_path, sizeof g_state_path, "%s", path);
    const char *al = st_get(s, "action_log");
    if (al && *al) snprintf(g_action_path, sizeof g_action_path, "%s", al);
    else snprintf(g_action_path, sizeof g_action_path, "%s.actions", path);
    g_refs++;
    pthread_rwlock_unlock(&g_lock);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_rwlock_wrlock(&g_lock);
    nvmlReturn_t r = g_refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (g_refs > 0) g_refs--;
    pthread_rwlock_unlock(&g_lock);
    return r;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case 23: return "Insufficient resources";
    case 24: return "Frequency not supported";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    case 999: return "Unknown Error";
    default: return "Unknown Error";
    }
}

/* ---- system ----------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t r = node_enter("nvmlSystemGetDriverVersion");
    if (r) return r;
    char v[128];
    if (!kv_str(v, sizeof v, "driver_version")) snprintf(v, sizeof v, "550.54.15");
    return copy_str(version, length, v);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t r = node_enter("nvmlSystemGetNVMLVersion");
    if (r) return r;
    char v[128];
    if (!kv_str(v, sizeof v, "nvml_version")) snprintf(v, sizeof v, "12.550.54.15");
    return copy_str(version, length, v);
}

static nvmlReturn_t cuda_version(const char *fn, int *v) {
    nvmlReturn_t r = node_enter(fn);
    if (r) return r;
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    *v = (int)kv_int(12040, "cuda_driver_version");
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { return cuda_version("nvmlSystemGetCudaDriverVersion", v); }
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return cuda_version("nvmlSystemGetCudaDriverVersion_v2", v); }

/* ---- device enumeration ------------------------------------------------------------------ */

static nvmlReturn_t device_count(const char *fn, unsigned int *count) {
    nvmlReturn_t r = node_enter(fn);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned)gpu_count();
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *c) { return device_count("nvmlDeviceGetCount_v2", c); }
EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *c) { return device_count("nvmlDeviceGetCount", c); }

/* Handle lookups go through the GPU's faults: a lost GPU fails here already, as
 * nvidia-smi's "Unable to determine the device handle for GPU ...: GPU is lost". */
static nvmlReturn_t handle_for(const char *fn, int g, int m, nvmlDevice_t *out) {
    nvmlReturn_t r = gpu_faults(fn, g, m);
    if (r) return r;
    *out = m >= 0 ? &g_migdev[g][m] : &g_dev[g];
    return NVML_SUCCESS;
}

static nvmlReturn_t handle_by_index(const char *fn, unsigned int index, nvmlDevice_t *out) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!out || index >= (unsigned)gpu_count()) return NVML_ERROR_INVALID_ARGUMENT;
    return handle_for(fn, (int)index, -1, out);
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    return handle_by_index("nvmlDeviceGetHandleByIndex_v2", i, d);
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d) {
    return handle_by_index("nvmlDeviceGetHandleByIndex", i, d);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *out) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !out) return NVML_ERROR_INVALID_ARGUMENT;
    char u[128];
    for (int g = 0, n = gpu_count(); g < n; g++) {
        gpu_uuid(g, u, sizeof u);
        if (strcmp(u, uuid) == 0) return handle_for("nvmlDeviceGetHandleByUUID", g, -1, out);
        for (int m = 0; m < MAX_MIG && mig_valid(g, m); m++)
            if (kv_str(u, sizeof u, "gpu.%d.mig.%d.uuid", g, m) && strcmp(u, uuid) == 0)
                return handle_for("nvmlDeviceGetHandleByUUID", g, m, out);
    }
    return NVML_ERROR_NOT_FOUND;
}

static nvmlReturn_t handle_by_bus(const char *fn, const char *bus_id, nvmlDevice_t *out) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    unsigned d0, b0, v0, f0, d1, b1, v1, f1;
    if (!bus_id || !out || !parse_bus_id(bus_id, &d0, &b0, &v0, &f0)) return NVML_ERROR_INVALID_ARGUMENT;
    char s[64];
    for (int g = 0, n = gpu_count(); g < n; g++) {
        gpu_bus_id(g, s, sizeof s);
        if (parse_bus_id(s, &d1, &b1, &v1, &f1) && d0 == d1 && b0 == b1 && v0 == v1 && f0 == f1)
            return handle_for(fn, g, -1, out);
    }
    return NVML_ERROR_NOT_FOUND;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *b, nvmlDevice_t *d) {
    return handle_by_bus("nvmlDeviceGetHandleByPciBusId_v2", b, d);
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *b, nvmlDevice_t *d) {
    return handle_by_bus("nvmlDeviceGetHandleByPciBusId", b, d);
}

/* ---- identity ------------------------------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *index) {
    ENTER_GPU("nvmlDeviceGetIndex", h, g);
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)g;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t h, unsigned int *minor) {
    ENTER_GPU("nvmlDeviceGetMinorNumber", h, g);
    if (!minor) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = (unsigned)kv_int(g, "gpu.%d.minor", g);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int length) {
    int g, m;
    nvmlReturn_t r = dev_enter("nvmlDeviceGetUUID", h, &g, &m);
    if (r) return r;
    char u[128];
    if (m >= 0) {
        if (!kv_str(u, sizeof u, "gpu.%d.mig.%d.uuid", g, m))
            snprintf(u, sizeof u, "MIG-5157ba00-0000-4000-8000-%08x%04x", g, m);
    } else {
        gpu_uuid(g, u, sizeof u);
    }
    return copy_str(uuid, length, u);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int length) {
    int g, m;
    nvmlReturn_t r = dev_enter("nvmlDeviceGetName", h, &g, &m);
    if (r) return r;
    char n[256];
    if (m >= 0) {
        if (!kv_str(n, sizeof n, "gpu.%d.mig.%d.name", g, m)) {
            char p[200];
            gpu_name(g, p, sizeof p);
            snprintf(n, sizeof n, "%s MIG", p);
        }
    } else {
        gpu_name(g, n, sizeof n);
    }
    return copy_str(name, length, n);
}

EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t h, char *serial, unsigned int length) {
    ENTER_GPU("nvmlDeviceGetSerial", h, g);
    char s[128];
    if (!kv_str(s, sizeof s, "gpu.%d.serial", g)) snprintf(s, sizeof s, "1654922%06d", g);
    return copy_str(serial, length, s);
}

EXPORT nvmlReturn_t nvmlDeviceGetVbiosVersion(nvmlDevice_t h, char *version, unsigned int length) {
    ENTER_GPU("nvmlDeviceGetVbiosVersion", h, g);
    char v[64];
    if (!kv_str(v, sizeof v, "gpu.%d.vbios", g)) snprintf(v, sizeof v, "96.00.99.00.01");
    return copy_str(version, length, v);
}

static nvmlReturn_t pci_info(const char *fn, nvmlDevice_t h, nvmlPciInfo_t *pci) {
    ENTER_GPU(fn, h, g);
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    char bus[64];
    gpu_bus_id(g, bus, sizeof bus);
    fill_pci(pci, bus, (unsigned)kv_int(0x233010DE, "gpu.%d.pci_device_id", g),
             (unsigned)kv_int(0x16C110DE, "gpu.%d.pci_subsystem_id", g));
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t h, nvmlPciInfo_t *p) { return pci_info("nvmlDeviceGetPciInfo_v3", h, p); }
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t h, nvmlPciInfo_t *p) { return pci_info("nvmlDeviceGetPciInfo_v2", h, p); }
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t h, nvmlPciInfo_t *p) { return pci_info("nvmlDeviceGetPciInfo", h, p); }

/* ---- memory, sensors, utilisation ------------------------------------------------------------ */

static void memory_of(int g, int m, unsigned long long *total, unsigned long long *used) {
    if (m >= 0) {
        *total = (unsigned long long)kv_int(4864ll << 20, "gpu.%d.mig.%d.memory_total", g, m);
        *used = (unsigned long long)kv_int(0, "gpu.%d.mig.%d.memory_used", g, m);
    } else {
        *total = (unsigned long long)kv_int(85520809984ll, "gpu.%d.memory_total", g);
        *used = (unsigned long long)kv_int(0, "gpu.%d.memory_used", g);
    }
    if (*used > *total) *used = *total;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *mem) {
    int g, m;
    nvmlReturn_t r = dev_enter("nvmlDeviceGetMemoryInfo", h, &g, &m);
    if (r) return r;
    if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
    memory_of(g, m, &mem->total, &mem->used);
    mem->free = mem->total - mem->used;
    return NVML_SUCCESS;
}

/* v2 splits the driver-reserved part out of "used" (memory_reserved, default 0). */
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *mem) {
    int g, m;
    nvmlReturn_t r = dev_enter("nvmlDeviceGetMemoryInfo_v2", h, &g, &m);
    if (r) return r;
    if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
    if (mem->version != NVML_MEMORY_V2_VERSION) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned long long total, used;
    memory_of(g, m, &total, &used);
    unsigned long long reserved = m >= 0 ? 0 : (unsigned long long)kv_int(0, "gpu.%d.memory_reserved", g);
    if (reserved > used) reserved = used;
    mem->total = total;
    mem->reserved = reserved;
    mem->used = used - reserved;
    mem->free = total - used;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t h, int sensor, unsigned int *temp) {
    ENTER_GPU("nvmlDeviceGetTemperature", h, g);
    if (!temp || sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = (unsigned)kv_int(35, "gpu.%d.temperature", g);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t h, nvmlTemperature_v1_t *t) {
    ENTER_GPU("nvmlDeviceGetTemperatureV", h, g);
    if (!t) return NVML_ERROR_INVALID_ARGUMENT;
    if (t->version != NVML_TEMPERATURE_V1_VERSION) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (t->sensorType != 0) return NVML_ERROR_INVALID_ARGUMENT;
    t->temperature = (int)kv_int(35, "gpu.%d.temperature", g);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t h, unsigned int *mw) {
    ENTER_GPU("nvmlDeviceGetPowerUsage", h, g);
    if (!mw) return NVML_ERROR_INVALID_ARGUMENT;
    *mw = (unsigned)kv_int(70000, "gpu.%d.power_mw", g);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t h, unsigned long long *mj) {
    ENTER_GPU("nvmlDeviceGetTotalEnergyConsumption", h, g);
    if (!mj) return NVML_ERROR_INVALID_ARGUMENT;
    *mj = (unsigned long long)kv_int(0, "gpu.%d.energy_mj", g);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *u) {
    ENTER_GPU("nvmlDeviceGetUtilizationRates", h, g);
    if (!u) return NVML_ERROR_INVALID_ARGUMENT;
    u->gpu = (unsigned)kv_int(0, "gpu.%d.gpu_util", g);
    u->memory = (unsigned)kv_int(0, "gpu.%d.mem_util", g);
    return NVML_SUCCESS;
}

/* ---- ECC, retired pages, remapped rows ------------------------------------------------------ */

EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t h, int *current, int *pending) {
    ENTER_GPU("nvmlDeviceGetEccMode", h, g);
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = (int)kv_int(1, "gpu.%d.ecc_mode", g);
    *pending = (int)kv_int(*current, "gpu.%d.ecc_mode_pending", g);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t h, int errorType, int counterType,
                                               unsigned long long *count) {
    ENTER_GPU("nvmlDeviceGetTotalEccErrors", h, g);
    if (!count || errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* With ECC disabled the counters are not available (as on real boards). */
    if (!kv_int(1, "gpu.%d.ecc_mode", g)) return NVML_ERROR_NOT_SUPPORTED;
    static const char *names[2][2] = {
        {"ecc_volatile_corrected", "ecc_aggregate_corrected"},
        {"ecc_volatile_uncorrected", "ecc_aggregate_uncorrected"},
    };
    *count = (unsigned long long)kv_int(0, "gpu.%d.%s", g, names[errorType][counterType]);
    return NVML_SUCCESS;
}

static nvmlReturn_t retired_pages(const char *fn, nvmlDevice_t h, int cause, unsigned int *count,
                                  unsigned long long *addresses, unsigned long long *timestamps) {
    ENTER_GPU(fn, h, g);
    if (!count || cause < 0 || cause > 1) return NVML_ERROR_INVALID_ARGUMENT;
    long long n = kv_int(0, cause == 0 ? "gpu.%d.retired_pages_sbe" : "gpu.%d.retired_pages_dbe", g);
    if (n < 0) n = 0;
    if (*count < (unsigned long long)n) {
        *count = (unsigned)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n > 0 && !addresses) return NVML_ERROR_INVALID_ARGUMENT;
    /* Synthetic but stable page addresses; timestamps a fixed point in the past. */
    for (long long i = 0; i < n; i++) {
        addresses[i] = 0x100000ull * (unsigned long long)(cause + 1) + 0x1000ull * (unsigned long long)i;
        if (timestamps) timestamps[i] = 1700000000ull + (unsigned long long)i;
    }
    *count = (unsigned)n;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t h, int cause, unsigned int *count,
                                             unsigned long long *addresses) {
    return retired_pages("nvmlDeviceGetRetiredPages", h, cause, count, addresses, NULL);
}
EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t h, int cause, unsigned int *count,
                                                unsigned long long *addresses, unsigned long long *timestamps) {
    return retired_pages("nvmlDeviceGetRetiredPages_v2", h, cause, count, addresses, timestamps);
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t h, int *pending) {
    ENTER_GPU("nvmlDeviceGetRetiredPagesPendingStatus", h, g);
    if (!pending) return NVML_ERROR_INVALID_ARGUMENT;
    *pending = kv_int(0, "gpu.%d.retired_pages_pending", g) ? 1 : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t h, unsigned int *corr, unsigned int *unc,
                                             unsigned int *pending, unsigned int *failure) {
    ENTER_GPU("nvmlDeviceGetRemappedRows", h, g);
    if (!corr || !unc || !pending || !failure) return NVML_ERROR_INVALID_ARGUMENT;
    *corr = (unsigned)kv_int(0, "gpu.%d.remapped_corrected", g);
    *unc = (unsigned)kv_int(0, "gpu.%d.remapped_uncorrected", g);
    *pending = kv_int(0, "gpu.%d.remapped_pending", g) ? 1 : 0;
    *failure = kv_int(0, "gpu.%d.remapped_failure", g) ? 1 : 0;
    return NVML_SUCCESS;
}

/* Per-bank spare-row availability (A100 and newer): how many banks have all, most, some, few
 * or none of their spare rows left.  A bank with none cannot remap another row. */
typedef struct { unsigned int max, high, partial, low, none; } nvmlRowRemapperHistogramValues_t;

EXPORT nvmlReturn_t nvmlDeviceGetRowRemapperHistogram(nvmlDevice_t h, nvmlRowRemapperHistogramValues_t *v) {
    ENTER_GPU("nvmlDeviceGetRowRemapperHistogram", h, g);
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    v->max = (unsigned)kv_int(2560, "gpu.%d.remap_hist_max", g);
    v->high = (unsigned)kv_int(0, "gpu.%d.remap_hist_high", g);
    v->partial = (unsigned)kv_int(0, "gpu.%d.remap_hist_partial", g);
    v->low = (unsigned)kv_int(0, "gpu.%d.remap_hist_low", g);
    v->none = (unsigned)kv_int(0, "gpu.%d.remap_hist_none", g);
    return NVML_SUCCESS;
}

/* ECC counts by memory location (nvmlMemoryLocation_t).  SRAM (7) has its own counters; DRAM (2)
 * is the total (ecc_*) less SRAM, so that DRAM + SRAM = nvmlDeviceGetTotalEccErrors, as on
 * Ampere/Hopper boards, which fold L1/L2/register file into SRAM: those locations are NOT_SUPPORTED. */
#define NVML_MEMORY_LOCATION_DRAM 2
#define NVML_MEMORY_LOCATION_SRAM 7
#define NVML_MEMORY_LOCATION_COUNT 8

EXPORT nvmlReturn_t nvmlDeviceGetMemoryErrorCounter(nvmlDevice_t h, int errorType, int counterType, int location,
                                                   unsigned long long *count) {
    ENTER_GPU("nvmlDeviceGetMemoryErrorCounter", h, g);
    if (!count || errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1 || location < 0 ||
        location >= NVML_MEMORY_LOCATION_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!kv_int(1, "gpu.%d.ecc_mode", g)) return NVML_ERROR_NOT_SUPPORTED;
    if (location != NVML_MEMORY_LOCATION_DRAM && location != NVML_MEMORY_LOCATION_SRAM) return NVML_ERROR_NOT_SUPPORTED;
    static const char *kinds[2] = {"corrected", "uncorrected"}, *counters[2] = {"volatile", "aggregate"};
    long long sram = kv_int(0, "gpu.%d.sram_%s_%s", g, counters[counterType], kinds[errorType]);
    if (location == NVML_MEMORY_LOCATION_SRAM) {
        *count = (unsigned long long)sram;
    } else {
        long long total = kv_int(0, "gpu.%d.ecc_%s_%s", g, counters[counterType], kinds[errorType]);
        *count = (unsigned long long)(total > sram ? total - sram : 0);
    }
    return NVML_SUCCESS;
}

/* ---- clocks, modes, PCIe ---------------------------------------------------------------------- */

static nvmlReturn_t clock_reasons(const char *fn, nvmlDevice_t h, unsigned long long *reasons) {
    ENTER_GPU(fn, h, g);
    if (!reasons) return NVML_ERROR_INVALID_ARGUMENT;
    *reasons = (unsigned long long)kv_int(0x1, "gpu.%d.clock_event_reasons", g);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t h, unsigned long long *r) {
    return clock_reasons("nvmlDeviceGetCurrentClocksEventReasons", h, r);
}
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t h, unsigned long long *r) {
    return clock_reasons("nvmlDeviceGetCurrentClocksThrottleReasons", h, r);
}

EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t h, int *mode) {
    ENTER_GPU("nvmlDeviceGetPersistenceMode", h, g);
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = kv_int(1, "gpu.%d.persistence_mode", g) ? 1 : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t h, int *pstate) {
    ENTER_GPU("nvmlDeviceGetPerformanceState", h, g);
    if (!pstate) return NVML_ERROR_INVALID_ARGUMENT;
    *pstate = (int)kv_int(0, "gpu.%d.pstate", g);
    return NVML_SUCCESS;
}

#define UINT_GETTER(sym, key, def)                                   \
    EXPORT nvmlReturn_t sym(nvmlDevice_t h, unsigned int *out) {      \
        ENTER_GPU(#sym, h, g);                                        \
        if (!out) return NVML_ERROR_INVALID_ARGUMENT;                 \
        *out = (unsigned)kv_int(def, "gpu.%d." key, g);               \
        return NVML_SUCCESS;                                          \
    }
UINT_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, "pcie_gen_cur", kv_int(5, "gpu.%d.pcie_gen_max", g))
UINT_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, "pcie_gen_max", 5)
UINT_GETTER(nvmlDeviceGetGpuMaxPcieLinkGeneration, "pcie_gen_gpu_max", kv_int(5, "gpu.%d.pcie_gen_max", g))
UINT_GETTER(nvmlDeviceGetCurrPcieLinkWidth, "pcie_width_cur", kv_int(16, "gpu.%d.pcie_width_max", g))
UINT_GETTER(nvmlDeviceGetMaxPcieLinkWidth, "pcie_width_max", 16)

/* ---- NvLink ----------------------------------------------------------------------------------
 * nvlink_count=0 (default): the board has no NvLink, every link query is NOT_SUPPORTED.
 * Otherwise links below nvlink_count answer; links from nvlink_count up to
 * NVML_NVLINK_MAX_LINKS are NOT_SUPPORTED (what tools that loop to MAX_LINKS expect),
 * and link >= NVML_NVLINK_MAX_LINKS is INVALID_ARGUMENT. */
static nvmlReturn_t nvlink_check(int g, unsigned int link) {
    if (link >= NVML_NVLINK_MAX_LINKS) return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= (unsigned long long)kv_int(0, "gpu.%d.nvlink_count", g)) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t h, unsigned int link, int *active) {
    ENTER_GPU("nvmlDeviceGetNvLinkState", h, g);
    if (!active) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = nvlink_check(g, link);
    if (r) return r;
    *active = kv_int(1, "gpu.%d.nvlink.%u.state", g, link) ? 1 : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t h, unsigned int link, nvmlPciInfo_t *pci) {
    ENTER_GPU("nvmlDeviceGetNvLinkRemotePciInfo_v2", h, g);
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = nvlink_check(g, link);
    if (r) return r;
    char bus[64];
    if (!kv_str(bus, sizeof bus, "gpu.%d.nvlink.%u.remote_bus_id", g, link)) snprintf(bus, sizeof bus, "00000000:00:00.0");
    fill_pci(pci, bus, (unsigned)kv_int(0x22A310DE, "gpu.%d.nvlink.%u.remote_device_id", g, link), 0);
    return NVML_SUCCESS;
}

/* ---- processes -------------------------------------------------------------------------------- */

/* Like the driver forgets exited processes: a pid that no longer exists is not listed, nor a zombie
 * (its files, the device's included, were closed in do_exit before it became one). */
static int pid_exists(long long pid) {
    if (pid <= 0 || pid > 0x7fffffff) return 0;
    if (kill((pid_t)pid, 0) == -1 && errno == ESRCH) return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 1;  /* another pid namespace's /proc: kill() said it exists */
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *close = strrchr(buf, ')');
    return !(close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X'));
}

/* Append the entries of "pid:bytes[:gi:ci],..." ('-' bytes: not available) to out[]. */
static unsigned parse_procs(const char *list, unsigned gi_def, unsigned ci_def, nvmlProcessInfo_t *out,
                            unsigned n, unsigned cap) {
    if (!list) return n;
    char *dup = strdup(list), *save = NULL;
    for (char *tok = strtok_r(dup, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *f[4] = {0};
        int nf = 0;
        char *s2 = NULL;
        for (char *p = strtok_r(tok, ":", &s2); p && nf < 4; p = strtok_r(NULL, ":", &s2)) f[nf++] = p;
        long long pid, v;
        if (nf < 1 || !parse_ll(f[0], &pid) || !pid_exists(pid)) continue;
        if (n < cap) {
            nvmlProcessInfo_t *pi = &out[n];
            pi->pid = (unsigned)pid;
            pi->usedGpuMemory = nf >= 2 && parse_ll(f[1], &v) ? (unsigned long long)v : NVML_VALUE_NOT_AVAILABLE_ULL;
            pi->gpuInstanceId = nf >= 3 && parse_ll(f[2], &v) ? (unsigned)v : gi_def;
            pi->computeInstanceId = nf >= 4 && parse_ll(f[3], &v) ? (unsigned)v : ci_def;
        }
        n++;
    }
    free(dup);
    return n;
}

static unsigned collect_procs(int g, int m, nvmlProcessInfo_t *out, unsigned cap) {
    unsigned n = 0;
    for (int k = 0; k < MAX_MIG && mig_valid(g, k); k++) {
        if (m >= 0 && k != m) continue;
        char *l = kv_dup("gpu.%d.mig.%d.procs", g, k);
        n = parse_procs(l, (unsigned)kv_int(k + 1, "gpu.%d.mig.%d.gi_id", g, k),
                        (unsigned)kv_int(0, "gpu.%d.mig.%d.ci_id", g, k), out, n, cap);
        free(l);
    }
    if (m < 0) {
        /* The parent GPU lists its own processes and those of all its MIG devices. */
        char *l = kv_dup("gpu.%d.procs", g);
        n = parse_procs(l, NVML_VALUE_NOT_AVAILABLE_UINT, NVML_VALUE_NOT_AVAILABLE_UINT, out, n, cap);
        free(l);
    }
    return n;
}

static nvmlReturn_t running_procs(const char *fn, nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos) {
    int g, m;
    nvmlReturn_t r = dev_enter(fn, h, &g, &m);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned need = collect_procs(g, m, NULL, 0);
    if (*count < need) {
        *count = need;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (need && !infos) return NVML_ERROR_INVALID_ARGUMENT;
    *count = need ? collect_procs(g, m, infos, need) : 0;
    if (*count > need) *count = need;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *c, nvmlProcessInfo_t *i) {
    return running_procs("nvmlDeviceGetComputeRunningProcesses_v3", h, c, i);
}
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t h, unsigned int *c, nvmlProcessInfo_t *i) {
    return running_procs("nvmlDeviceGetComputeRunningProcesses_v2", h, c, i);
}

/* ---- MIG ---------------------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *current, unsigned int *pending) {
    ENTER_GPU("nvmlDeviceGetMigMode", h, g);
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = kv_int(0, "gpu.%d.mig_mode", g) ? 1 : 0;
    *pending = kv_int(*current, "gpu.%d.mig_mode_pending", g) ? 1 : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t h, unsigned int *count) {
    ENTER_GPU("nvmlDeviceGetMaxMigDeviceCount", h, g);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    long long mx = kv_int(0, "gpu.%d.mig_mode", g) ? kv_int(7, "gpu.%d.mig_max_count", g) : 0;
    *count = (unsigned)(mx > MAX_MIG ? MAX_MIG : mx);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t h, unsigned int index, nvmlDevice_t *mig) {
    int g, m;
    nvmlReturn_t r = dev_enter("nvmlDeviceGetMigDeviceHandleByIndex", h, &g, &m);
    if (r) return r;
    if (m >= 0 || !mig) return NVML_ERROR_INVALID_ARGUMENT;
    if (!kv_int(0, "gpu.%d.mig_mode", g)) return NVML_ERROR_NOT_SUPPORTED;
    if (index >= MAX_MIG || index >= (unsigned long long)kv_int(7, "gpu.%d.mig_max_count", g))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!mig_valid(g, (int)index)) return NVML_ERROR_NOT_FOUND;
    *mig = &g_migdev[g][index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t h, unsigned int *is_mig) {
    int g, m;
    nvmlReturn_t r = dev_enter("nvmlDeviceIsMigDeviceHandle", h, &g, &m);
    if (r) return r;
    if (!is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *is_mig = m >= 0;
    return NVML_SUCCESS;
}

/* On a physical GPU handle the MIG-only queries are NOT_SUPPORTED. */
static nvmlReturn_t mig_id(const char *fn, nvmlDevice_t h, unsigned int *id, int ci) {
    int g, m;
    nvmlReturn_t r = dev_enter(fn, h, &g, &m);
    if (r) return r;
    if (!id) return NVML_ERROR_INVALID_ARGUMENT;
    if (m < 0) return NVML_ERROR_NOT_SUPPORTED;
    *id = ci ? (unsigned)kv_int(0, "gpu.%d.mig.%d.ci_id", g, m) : (unsigned)kv_int(m + 1, "gpu.%d.mig.%d.gi_id", g, m);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t h, unsigned int *id) {
    return mig_id("nvmlDeviceGetGpuInstanceId", h, id, 0);
}
EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t h, unsigned int *id) {
    return mig_id("nvmlDeviceGetComputeInstanceId", h, id, 1);
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t h, nvmlDevice_t *parent) {
    int g, m;
    nvmlReturn_t r = dev_enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", h, &g, &m);
    if (r) return r;
    if (!parent) return NVML_ERROR_INVALID_ARGUMENT;
    if (m < 0) return NVML_ERROR_NOT_SUPPORTED;
    *parent = &g_dev[g];
    return NVML_SUCCESS;
}

/* nvmlDeviceAttributes_t: Slurm's gpu_nvml.so names a MIG slice from it when the device name
 * carries no "MIG <profile>" (src/plugins/gpu/nvml/gpu_nvml.c, _handle_mig). Slices come from
 * gpu.<i>.mig.<k>.gi_slices / ci_slices, or else from the profile in the MIG device's name. */
typedef struct {
    unsigned int multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount,
        sharedJpegCount, sharedOfaCount, gpuInstanceSliceCount, computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

static void mig_slices_from_name(int g, int m, unsigned *gi, unsigned *ci) {
    char n[256];
    unsigned a = 0, b = 0;
    *gi = *ci = 1;
    if (!kv_str(n, sizeof n, "gpu.%d.mig.%d.name", g, m)) return;
    const char *p = strstr(n, " MIG ");
    if (!p) return;
    p += 5;
    if (sscanf(p, "%uc.%ug.", &a, &b) == 2) { *ci = a; *gi = b; }
    else if (sscanf(p, "%ug.", &b) == 1) { *ci = *gi = b; }
}

EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t h, nvmlDeviceAttributes_t *attr) {
    int g, m;
    nvmlReturn_t r = dev_enter("nvmlDeviceGetAttributes_v2", h, &g, &m);
    if (r) return r;
    if (!attr) return NVML_ERROR_INVALID_ARGUMENT;
    if (m < 0) return NVML_ERROR_NOT_SUPPORTED;
    unsigned gi, ci;
    mig_slices_from_name(g, m, &gi, &ci);
    unsigned long long total, used;
    memory_of(g, m, &total, &used);
    memset(attr, 0, sizeof *attr);
    attr->gpuInstanceSliceCount = (unsigned)kv_int(gi, "gpu.%d.mig.%d.gi_slices", g, m);
    attr->computeInstanceSliceCount = (unsigned)kv_int(ci, "gpu.%d.mig.%d.ci_slices", g, m);
    attr->multiprocessorCount = 14 * attr->computeInstanceSliceCount;
    attr->memorySizeMB = total >> 20;
    return NVML_SUCCESS;
}

/* Application clocks, supported clocks and per-process utilisation: Slurm's gpu_nvml.so links
 * against them (--gpu-freq, step accounting); this simulation does not model them. */
EXPORT nvmlReturn_t nvmlDeviceGetApplicationsClock(nvmlDevice_t h, int type, unsigned int *mhz) {
    ENTER_GPU("nvmlDeviceGetApplicationsClock", h, g);
    (void)type; (void)mhz; (void)g;
    return NVML_ERROR_NOT_SUPPORTED;
}
EXPORT nvmlReturn_t nvmlDeviceSetApplicationsClocks(nvmlDevice_t h, unsigned int mem_mhz, unsigned int gr_mhz) {
    ENTER_GPU("nvmlDeviceSetApplicationsClocks", h, g);
    (void)mem_mhz; (void)gr_mhz; (void)g;
    return NVML_ERROR_NOT_SUPPORTED;
}
EXPORT nvmlReturn_t nvmlDeviceGetSupportedMemoryClocks(nvmlDevice_t h, unsigned int *count, unsigned int *mhz) {
    ENTER_GPU("nvmlDeviceGetSupportedMemoryClocks", h, g);
    (void)count; (void)mhz; (void)g;
    return NVML_ERROR_NOT_SUPPORTED;
}
EXPORT nvmlReturn_t nvmlDeviceGetSupportedGraphicsClocks(nvmlDevice_t h, unsigned int mem_mhz, unsigned int *count,
                                                         unsigned int *mhz) {
    ENTER_GPU("nvmlDeviceGetSupportedGraphicsClocks", h, g);
    (void)mem_mhz; (void)count; (void)mhz; (void)g;
    return NVML_ERROR_NOT_SUPPORTED;
}
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t h, void *samples, unsigned int *count,
                                                    unsigned long long since) {
    ENTER_GPU("nvmlDeviceGetProcessUtilization", h, g);
    (void)samples; (void)count; (void)since; (void)g;
    return NVML_ERROR_NOT_SUPPORTED;
}
/* Graphics processes: none on these compute GPUs. */
EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos) {
    int g, m;
    nvmlReturn_t r = dev_enter("nvmlDeviceGetGraphicsRunningProcesses_v3", h, &g, &m);
    if (r) return r;
    (void)infos;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = 0;
    return NVML_SUCCESS;
}

/* ---- accounting ----------------------------------------------------------------------------------
 * Records: gpu.<i>.acct=pid:gpu_util:mem_util:max_mem:time_ms:start_us:is_running;...
 * Visible only while accounting_mode=1 (else NOT_SUPPORTED, as the driver documents). */

typedef struct { unsigned pid; nvmlAccountingStats_t st; } acct_rec_t;

static int parse_acct(const char *list, acct_rec_t *out, int cap) {
    if (!list) return 0;
    int n = 0;
    char *dup = strdup(list), *save = NULL;
    for (char *tok = strtok_r(dup, ";", &save); tok; tok = strtok_r(NULL, ";", &save)) {
        long long v[7] = {0, 0, 0, 0, 0, 0, 0};
        int nf = 0;
        char *s2 = NULL;
        for (char *p = strtok_r(tok, ":", &s2); p && nf < 7; p = strtok_r(NULL, ":", &s2)) {
            if (strcmp(p, "-") == 0) v[nf] = -1;
            else if (!parse_ll(p, &v[nf])) break;
            nf++;
        }
        if (nf < 1 || v[0] <= 0) continue;
        if (n < cap) {
            acct_rec_t *a = &out[n];
            memset(a, 0, sizeof *a);
            a->pid = (unsigned)v[0];
            a->st.gpuUtilization = (unsigned)v[1];
            a->st.memoryUtilization = (unsigned)v[2];
            a->st.maxMemoryUsage = v[3] < 0 ? NVML_VALUE_NOT_AVAILABLE_ULL : (unsigned long long)v[3];
            a->st.time = (unsigned long long)v[4];
            a->st.startTime = (unsigned long long)v[5];
            a->st.isRunning = v[6] ? 1 : 0;
        }
        n++;
    }
    free(dup);
    return n;
}

static int load_acct(int g, acct_rec_t **out) {
    char *l = kv_dup("gpu.%d.acct", g);
    int n = parse_acct(l, NULL, 0);
    *out = calloc((size_t)n + 1, sizeof(acct_rec_t));
    parse_acct(l, *out, n);
    free(l);
    return n;
}

EXPORT nvmlReturn_t nvmlDeviceGetAccountingMode(nvmlDevice_t h, int *mode) {
    ENTER_GPU("nvmlDeviceGetAccountingMode", h, g);
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = kv_int(0, "gpu.%d.accounting_mode", g) ? 1 : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetAccountingBufferSize(nvmlDevice_t h, unsigned int *size) {
    ENTER_GPU("nvmlDeviceGetAccountingBufferSize", h, g);
    if (!size) return NVML_ERROR_INVALID_ARGUMENT;
    if (!kv_int(0, "gpu.%d.accounting_mode", g)) return NVML_ERROR_NOT_SUPPORTED;
    *size = (unsigned)kv_int(4000, "gpu.%d.accounting_buffer_size", g);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetAccountingPids(nvmlDevice_t h, unsigned int *count, unsigned int *pids) {
    ENTER_GPU("nvmlDeviceGetAccountingPids", h, g);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (!kv_int(0, "gpu.%d.accounting_mode", g)) return NVML_ERROR_NOT_SUPPORTED;
    acct_rec_t *recs;
    int n = load_acct(g, &recs);
    if (*count < (unsigned)n) {
        *count = (unsigned)n;
        free(recs);
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n && !pids) { free(recs); return NVML_ERROR_INVALID_ARGUMENT; }
    for (int i = 0; i < n; i++) pids[i] = recs[i].pid;
    *count = (unsigned)n;
    free(recs);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetAccountingStats(nvmlDevice_t h, unsigned int pid, nvmlAccountingStats_t *stats) {
    ENTER_GPU("nvmlDeviceGetAccountingStats", h, g);
    if (!stats) return NVML_ERROR_INVALID_ARGUMENT;
    if (!kv_int(0, "gpu.%d.accounting_mode", g)) return NVML_ERROR_NOT_SUPPORTED;
    acct_rec_t *recs;
    int n = load_acct(g, &recs);
    nvmlReturn_t r = NVML_ERROR_NOT_FOUND;
    /* The newest record of a pid wins (pids can be reused within the buffer). */
    for (int i = n - 1; i >= 0; i--)
        if (recs[i].pid == pid) { *stats = recs[i].st; r = NVML_SUCCESS; break; }
    free(recs);
    return r;
}

/* ---- CPU affinity ------------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t h, unsigned int size, unsigned long *set) {
    ENTER_GPU("nvmlDeviceGetCpuAffinity", h, g);
    if (!set || size == 0) return NVML_ERROR_INVALID_ARGUMENT;
    memset(set, 0, size * sizeof(unsigned long));
    char *l = kv_dup("gpu.%d.cpu_affinity", g);
    if (!l) {
        /* Default: every CPU of this machine, as on a single-socket box. */
        char buf[64];
        snprintf(buf, sizeof buf, "0-%ld", sysconf(_SC_NPROCESSORS_CONF) - 1);
        l = strdup(buf);
    }
    char *save = NULL;
    const unsigned bits = 8 * sizeof(unsigned long);
    for (char *tok = strtok_r(l, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        long a, b;
        int k = sscanf(tok, "%ld-%ld", &a, &b);
        if (k < 1 || a < 0) continue;
        if (k == 1) b = a;
        for (long c = a; c <= b; c++)
            if ((unsigned long)c / bits < size) set[c / bits] |= 1ul << (c % bits);
    }
    free(l);
    return NVML_SUCCESS;
}

/* ---- mutating calls ---------------------------------------------------------------------------------
 * Each applies to the state by appending override lines with ONE O_APPEND write and records ONE
 * action-log line.  An exclusive flock on the state file serialises concurrent writers so the
 * counters (read back from the file under the lock) are exact. */

enum { M_PERSIST, M_APP_CLOCKS, M_GPU_LOCKED, M_MEM_LOCKED, M_ACCT_MODE, M_ACCT_CLEAR, M_POWER_LIMIT };

static void strbuf_add(char **buf, size_t *len, size_t *cap, const char *fmt, ...) {
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        int k = vsnprintf(*buf + *len, *cap - *len, fmt, ap);
        va_end(ap);
        if (k >= 0 && (size_t)k < *cap - *len) { *len += (size_t)k; return; }
        *cap = *cap * 2 + (size_t)(k > 0 ? k : 0);
        *buf = realloc(*buf, *cap);
        if (!*buf) abort();
    }
}

static nvmlReturn_t mutate(int g, const char *fn, int kind, int arg) {
    char path[4096], apath[sizeof g_action_path];
    pthread_rwlock_rdlock(&g_lock);
    snprintf(path, sizeof path, "%s", g_state_path);
    snprintf(apath, sizeof apath, "%s", g_action_path);
    pthread_rwlock_unlock(&g_lock);

    int fd = open(path, O_RDWR | O_APPEND | O_CLOEXEC);
    if (fd < 0) return errno == EACCES || errno == EROFS || errno == EPERM ? NVML_ERROR_NO_PERMISSION : NVML_ERROR_UNKNOWN;
    flock(fd, LOCK_EX);
    store_t *cur = st_load(path);
    if (!cur) cur = st_new();
    char key[256];
    size_t len = 0, cap = 512;
    char *buf = malloc(cap);
    buf[0] = 0;
    struct stat sb;
    char last = '\n';
    if (fstat(fd, &sb) == 0 && sb.st_size > 0 && pread(fd, &last, 1, sb.st_size - 1) != 1) last = '\n';
    if (last != '\n') strbuf_add(&buf, &len, &cap, "\n");

    static const char *counters[] = {"persistence_mode_sets", "app_clocks_resets", "gpu_locked_clocks_resets",
                                     "mem_locked_clocks_resets", "accounting_mode_sets", "accounting_clears",
                                     "power_limit_sets"};
    snprintf(key, sizeof key, "gpu.%d.%s", g, counters[kind]);
    long long cnt = 0;
    const char *cv = st_get(cur, key);
    if (cv) parse_ll(cv, &cnt);
    strbuf_add(&buf, &len, &cap, "%s=%lld\n", key, cnt + 1);

    char args[64] = "";
    if (kind == M_PERSIST) {
        strbuf_add(&buf, &len, &cap, "gpu.%d.persistence_mode=%d\n", g, arg);
        snprintf(args, sizeof args, "mode=%d", arg);
    } else if (kind == M_APP_CLOCKS || kind == M_GPU_LOCKED) {
        /* The clocks are back to default: no more "clocks limited by an application setting". */
        snprintf(key, sizeof key, "gpu.%d.clock_event_reasons", g);
        long long reasons;
        if ((cv = st_get(cur, key)) && parse_ll(cv, &reasons) && (reasons & 0x2))
            strbuf_add(&buf, &len, &cap, "%s=0x%llx\n", key, (unsigned long long)(reasons & ~0x2ll));
    } else if (kind == M_POWER_LIMIT) {
        strbuf_add(&buf, &len, &cap, "gpu.%d.power_limit_mw=%d\n", g, arg);
        snprintf(args, sizeof args, "limit_mw=%d", arg);
    } else if (kind == M_ACCT_MODE) {
        strbuf_add(&buf, &len, &cap, "gpu.%d.accounting_mode=%d\n", g, arg);
        /* Disabling accounting drops all records (nvml.h). */
        if (!arg) strbuf_add(&buf, &len, &cap, "gpu.%d.acct=\n", g);
        snprintf(args, sizeof args, "mode=%d", arg);
    } else if (kind == M_ACCT_CLEAR) {
        /* Clearing drops the records of processes that have terminated; running ones stay. */
        snprintf(key, sizeof key, "gpu.%d.acct", g);
        const char *list = st_get(cur, key);
        strbuf_add(&buf, &len, &cap, "%s=", key);
        if (list) {
            char *dup = strdup(list), *save = NULL;
            int first = 1;
            for (char *tok = strtok_r(dup, ";", &save); tok; tok = strtok_r(NULL, ";", &save)) {
                acct_rec_t rec;
                if (parse_acct(tok, &rec, 1) == 1 && rec.st.isRunning) {
                    strbuf_add(&buf, &len, &cap, "%s%s", first ? "" : ";", tok);
                    first = 0;
                }
            }
            free(dup);
        }
        strbuf_add(&buf, &len, &cap, "\n");
    }
    nvmlReturn_t r = NVML_SUCCESS;
    if (write(fd, buf, len) != (ssize_t)len) r = NVML_ERROR_UNKNOWN;

    if (r == NVML_SUCCESS) {
        char uuid[128], line[1024];
        snprintf(key, sizeof key, "gpu.%d.uuid", g);
        if ((cv = st_get(cur, key))) snprintf(uuid, sizeof uuid, "%s", cv);
        else gpu_uuid(g, uuid, sizeof uuid);
        struct timeval tv;
        gettimeofday(&tv, NULL);
        int k = snprintf(line, sizeof line, "%ld.%03ld gpu=%d uuid=%s %s%s%s\n", (long)tv.tv_sec,
                         (long)(tv.tv_usec / 1000), g, uuid, fn, args[0] ? " " : "", args);
        int afd = open(apath, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
        if (afd < 0 || write(afd, line, (size_t)k) != k) r = NVML_ERROR_UNKNOWN;
        if (afd >= 0) close(afd);
    }
    flock(fd, LOCK_UN);
    close(fd);
    st_free(cur);

    /* This process sees its own change at once, as with the real driver. */
    if (r == NVML_SUCCESS) {
        pthread_rwlock_wrlock(&g_lock);
        if (g_store) st_parse(g_store, buf, len);
        pthread_rwlock_unlock(&g_lock);
    }
    free(buf);
    return r;
}

#define MUTATOR(sym, kind)                                                  \
    EXPORT nvmlReturn_t sym(nvmlDevice_t h) {                               \
        ENTER_GPU(#sym, h, g);                                              \
        return mutate(g, #sym, kind, 0);                                    \
    }
MUTATOR(nvmlDeviceResetApplicationsClocks, M_APP_CLOCKS)
MUTATOR(nvmlDeviceResetGpuLockedClocks, M_GPU_LOCKED)
MUTATOR(nvmlDeviceResetMemoryLockedClocks, M_MEM_LOCKED)
MUTATOR(nvmlDeviceClearAccountingPids, M_ACCT_CLEAR)

EXPORT nvmlReturn_t nvmlDeviceSetPersistenceMode(nvmlDevice_t h, int mode) {
    ENTER_GPU("nvmlDeviceSetPersistenceMode", h, g);
    if (mode != 0 && mode != 1) return NVML_ERROR_INVALID_ARGUMENT;
    return mutate(g, "nvmlDeviceSetPersistenceMode", M_PERSIST, mode);
}

/* Within [power_min_limit_mw (default 200000), power_max_limit_mw (default: the default limit)]. */
EXPORT nvmlReturn_t nvmlDeviceSetPowerManagementLimit(nvmlDevice_t h, unsigned int mw) {
    ENTER_GPU("nvmlDeviceSetPowerManagementLimit", h, g);
    long long lo = kv_int(200000, "gpu.%d.power_min_limit_mw", g);
    long long hi = kv_int(kv_int(700000, "gpu.%d.power_default_limit_mw", g), "gpu.%d.power_max_limit_mw", g);
    if ((long long)mw < lo || (long long)mw > hi) return NVML_ERROR_INVALID_ARGUMENT;
    return mutate(g, "nvmlDeviceSetPowerManagementLimit", M_POWER_LIMIT, (int)mw);
}

EXPORT nvmlReturn_t nvmlDeviceSetAccountingMode(nvmlDevice_t h, int mode) {
    ENTER_GPU("nvmlDeviceSetAccountingMode", h, g);
    if (mode != 0 && mode != 1) return NVML_ERROR_INVALID_ARGUMENT;
    return mutate(g, "nvmlDeviceSetAccountingMode", M_ACCT_MODE, mode);
}

/* ---- fabric, field values, InfoROM, power limits, fans, clocks, violation counters -------------
 * (issue 25: the faults no check caught).  Layouts as in nvidia-ml-py's pynvml.py:
 * c_nvmlGpuFabricInfo_v2_t / _v3_t (selected by their version field), c_nvmlFieldValue_t,
 * c_nvmlViolationTime_t.  Every getter takes the usual per-GPU error/hang injection
 * (gpu.N.error.<function>=3 is the per-GPU NOT_SUPPORTED switch). */

#define NVML_GPU_FABRIC_INFO_V2 0x02000024u
#define NVML_GPU_FABRIC_INFO_V3 0x03000028u
#define NVML_ERROR_CORRUPTED_INFOROM 14

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
    unsigned char healthSummary; /* v3 only */
} nvmlGpuFabricInfo_v3_t;

/* fabric_state: 0 NOT_SUPPORTED (default: no NVSwitch fabric), 1 NOT_STARTED, 2 IN_PROGRESS,
 * 3 COMPLETED; fabric_status: an NVML return code (the registration's result); fabric_clique_id. */
EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t h, nvmlGpuFabricInfo_v3_t *info) {
    ENTER_GPU("nvmlDeviceGetGpuFabricInfoV", h, g);
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int version = info->version;
    if (version != NVML_GPU_FABRIC_INFO_V2 && version != NVML_GPU_FABRIC_INFO_V3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    size_t size = version == NVML_GPU_FABRIC_INFO_V2 ? 36 : sizeof *info;
    memset(info, 0, size);
    info->version = version;
    for (int i = 0; i < 16; i++) info->clusterUuid[i] = (unsigned char)kv_int(0, "gpu.%d.fabric_cluster_byte", g);
    info->status = (nvmlReturn_t)kv_int(0, "gpu.%d.fabric_status", g);
    info->cliqueId = (unsigned)kv_int(0, "gpu.%d.fabric_clique_id", g);
    info->state = (unsigned)kv_int(0, "gpu.%d.fabric_state", g);
    info->healthMask = (unsigned)kv_int(0, "gpu.%d.fabric_health_mask", g);
    if (version == NVML_GPU_FABRIC_INFO_V3) info->healthSummary = (unsigned char)kv_int(0, "gpu.%d.fabric_health_summary", g);
    return NVML_SUCCESS;
}

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230

/* gpu.N.field.<id>=value (unsigned int); gpu.N.field_error.<id>=code sets that entry's
 * nvmlReturn.  Field 230 (recovery action) defaults to 0 (NONE); other unset fields answer
 * NOT_SUPPORTED in their entry, as the driver does for a field a GPU lacks. */
EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t h, int count, nvmlFieldValue_t *values) {
    ENTER_GPU("nvmlDeviceGetFieldValues", h, g);
    if (!values || count < 0) return NVML_ERROR_INVALID_ARGUMENT;
    struct timeval tv;
    gettimeofday(&tv, NULL);
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        unsigned id = v->fieldId;
        v->timestamp = (long long)tv.tv_sec * 1000000 + tv.tv_usec;
        v->latencyUsec = 0;
        v->valueType = 1; /* NVML_VALUE_TYPE_UNSIGNED_INT */
        v->value.ullVal = 0;
        long long err = kv_int(-1, "gpu.%d.field_error.%u", g, id);
        long long def = id == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION ? 0 : -1;
        long long val = kv_int(def, "gpu.%d.field.%u", g, id);
        if (err > 0) v->nvmlReturn = (nvmlReturn_t)err;
        else if (val < 0) v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        else { v->nvmlReturn = NVML_SUCCESS; v->value.uiVal = (unsigned)val; }
    }
    return NVML_SUCCESS;
}

/* inforom_corrupted=1: the InfoROM checksum fails (NVML_ERROR_CORRUPTED_INFOROM). */
EXPORT nvmlReturn_t nvmlDeviceValidateInforom(nvmlDevice_t h) {
    ENTER_GPU("nvmlDeviceValidateInforom", h, g);
    return kv_int(0, "gpu.%d.inforom_corrupted", g) ? NVML_ERROR_CORRUPTED_INFOROM : NVML_SUCCESS;
}

/* power_default_limit_mw (default 700000, an H100 SXM's TDP); power_limit_mw: the enforced
 * limit (default: the default limit). */
static long long power_default(int g) { return kv_int(700000, "gpu.%d.power_default_limit_mw", g); }
static long long power_limit(int g) { return kv_int(power_default(g), "gpu.%d.power_limit_mw", g); }

#define POWER_GETTER(sym, value)                                     \
    EXPORT nvmlReturn_t sym(nvmlDevice_t h, unsigned int *mw) {      \
        ENTER_GPU(#sym, h, g);                                        \
        if (!mw) return NVML_ERROR_INVALID_ARGUMENT;                  \
        *mw = (unsigned)value(g);                                     \
        return NVML_SUCCESS;                                          \
    }
POWER_GETTER(nvmlDeviceGetPowerManagementDefaultLimit, power_default)
POWER_GETTER(nvmlDeviceGetEnforcedPowerLimit, power_limit)
POWER_GETTER(nvmlDeviceGetPowerManagementLimit, power_limit)

/* fan_count (default 0: a passively cooled board); fan.F.speed_pct (default 30),
 * fan.F.target_pct (default: the speed). */
EXPORT nvmlReturn_t nvmlDeviceGetNumFans(nvmlDevice_t h, unsigned int *n) {
    ENTER_GPU("nvmlDeviceGetNumFans", h, g);
    if (!n) return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned)kv_int(0, "gpu.%d.fan_count", g);
    return NVML_SUCCESS;
}
static nvmlReturn_t fan_value(const char *fn, nvmlDevice_t h, unsigned int fan, unsigned int *out, int target) {
    ENTER_GPU(fn, h, g);
    if (!out || fan >= (unsigned)kv_int(0, "gpu.%d.fan_count", g)) return NVML_ERROR_INVALID_ARGUMENT;
    long long speed = kv_int(30, "gpu.%d.fan.%u.speed_pct", g, fan);
    *out = (unsigned)(target ? kv_int(speed, "gpu.%d.fan.%u.target_pct", g, fan) : speed);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetFanSpeed_v2(nvmlDevice_t h, unsigned int fan, unsigned int *s) {
    return fan_value("nvmlDeviceGetFanSpeed_v2", h, fan, s, 0);
}
EXPORT nvmlReturn_t nvmlDeviceGetTargetFanSpeed(nvmlDevice_t h, unsigned int fan, unsigned int *s) {
    return fan_value("nvmlDeviceGetTargetFanSpeed", h, fan, s, 1);
}

/* clock.<type>_mhz / max_clock.<type>_mhz, type graphics (0), sm (1), mem (2), video (3);
 * defaults an H100 SXM's maxima (1980, 1980, 2619, 1755), the current clocks at the maxima. */
static const char *clock_key(int type) {
    static const char *names[] = {"graphics", "sm", "mem", "video"};
    return type >= 0 && type < 4 ? names[type] : NULL;
}
static long long clock_max(int g, int type) {
    static const long long def[] = {1980, 1980, 2619, 1755};
    return kv_int(def[type], "gpu.%d.max_clock.%s_mhz", g, clock_key(type));
}
EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t h, int type, unsigned int *mhz) {
    ENTER_GPU("nvmlDeviceGetMaxClockInfo", h, g);
    if (!mhz || !clock_key(type)) return NVML_ERROR_INVALID_ARGUMENT;
    *mhz = (unsigned)clock_max(g, type);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t h, int type, unsigned int *mhz) {
    ENTER_GPU("nvmlDeviceGetClockInfo", h, g);
    if (!mhz || !clock_key(type)) return NVML_ERROR_INVALID_ARGUMENT;
    *mhz = (unsigned)kv_int(clock_max(g, type), "gpu.%d.clock.%s_mhz", g, clock_key(type));
    return NVML_SUCCESS;
}

typedef struct { unsigned long long referenceTime, violationTime; } nvmlViolationTime_t;

/* violation.<policy>_ns: the time (ns) clocks were held below their target by that policy
 * (0 power, 1 thermal, 2 sync boost, 3 board limit, 4 low utilisation, 5 reliability, 10 total
 * app clocks, 11 total base clocks); referenceTime is now in microseconds. */
EXPORT nvmlReturn_t nvmlDeviceGetViolationStatus(nvmlDevice_t h, int policy, nvmlViolationTime_t *t) {
    ENTER_GPU("nvmlDeviceGetViolationStatus", h, g);
    if (!t || policy < 0 || policy > 11) return NVML_ERROR_INVALID_ARGUMENT;
    struct timeval tv;
    gettimeofday(&tv, NULL);
    t->referenceTime = (unsigned long long)tv.tv_sec * 1000000ull + (unsigned long long)tv.tv_usec;
    t->violationTime = (unsigned long long)kv_int(0, "gpu.%d.violation.%d_ns", g, policy);
    return NVML_SUCCESS;
}
