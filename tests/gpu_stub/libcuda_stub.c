/*
 * A stand-in libcuda.so.1 for tests on hosts without a GPU: the CUDA driver functions kvnode
 * calls, with "device memory" in host memory. It lets the tests run kvnode's real CUDA code
 * (cudarc's dynamic loading, the probe, context binding per thread, host registration,
 * asynchronous copies) and the GPU bench end to end. It checks what the real driver checks
 * and kvnode relies on: a context current on the calling thread, device ranges inside one
 * allocation, no overlapping host registrations, unregistering only what was registered.
 *
 * Variants (compile-time): -DSTUB_VERSION=11080 (old driver), -DSTUB_NO_DEVICE (cuInit fails
 * with CUDA_ERROR_NO_DEVICE), -DSTUB_MISSING_REGISTER (no cuMemHostRegister_v2), -DSTUB_DMABUF
 * (dma-buf export supported: a memfd stands in for the dma-buf).
 *
 * Not a GPU: copies are memcpy at host speed; streams run synchronously.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;

#ifndef STUB_VERSION
#define STUB_VERSION 12080
#endif

enum {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
    ALREADY_REGISTERED = 712,
    NOT_REGISTERED = 713,
    NOT_SUPPORTED = 801,
};

#define MAX_RANGES 4096
struct range { uintptr_t start; size_t len; };
static struct range allocs[MAX_RANGES];
static struct range registered[MAX_RANGES];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int inited;
static int the_context;
static __thread CUcontext current;
static const size_t TOTAL = (size_t)8 << 30;
static size_t used;

static int find(struct range *t, uintptr_t p, size_t n) {
    for (int i = 0; i < MAX_RANGES; i++)
        if (t[i].len && p >= t[i].start && p + n <= t[i].start + t[i].len) return i;
    return -1;
}

static CUresult need_ctx(void) {
    if (!inited) return NOT_INITIALIZED;
    return current == &the_context ? OK : INVALID_CONTEXT;
}

CUresult cuInit(unsigned flags) {
    (void)flags;
#ifdef STUB_NO_DEVICE
    return NO_DEVICE;
#endif
    inited = 1;
    return OK;
}
CUresult cuDriverGetVersion(int *v) { *v = STUB_VERSION; return OK; }
CUresult cuGetErrorName(CUresult e, const char **s) {
    static __thread char buf[48];
    snprintf(buf, sizeof buf, "STUB_CUDA_ERROR_%d", e);
    *s = buf;
    return OK;
}
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "stub driver error"; return OK; }
CUresult cuDeviceGetCount(int *c) { if (!inited) return NOT_INITIALIZED; *c = 1; return OK; }
CUresult cuDeviceGet(CUdevice *d, int o) { if (!inited) return NOT_INITIALIZED; if (o != 0) return INVALID_DEVICE; *d = 0; return OK; }
CUresult cuDeviceGetName(char *n, int len, CUdevice d) { (void)d; snprintf(n, len, "kvnode stub GPU"); return OK; }
CUresult cuDeviceTotalMem_v2(size_t *b, CUdevice d) { (void)d; *b = TOTAL; return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    (void)d;
#ifdef STUB_DMABUF
    *v = attr == 124;
#else
    (void)attr;
    *v = 0;
#endif
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { (void)d; *c = &the_context; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return OK; }
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return OK; }
/* A per-thread context stack, as the driver keeps it: push makes a context current, pop
 * restores the one before (kvnode must leave the caller's context as it found it). */
#define STACK 16
static __thread CUcontext stack[STACK];
static __thread int depth;
CUresult cuCtxPushCurrent_v2(CUcontext c) {
    if (!c) return INVALID_CONTEXT;
    if (depth == STACK) return OUT_OF_MEMORY;
    stack[depth++] = current;
    current = c;
    return OK;
}
CUresult cuCtxPopCurrent_v2(CUcontext *out) {
    if (!depth) return INVALID_CONTEXT;
    if (out) *out = current;
    current = stack[--depth];
    return OK;
}
CUresult cuCtxSynchronize(void) { return need_ctx(); }
CUresult cuStreamCreate(CUstream *s, unsigned f) { (void)f; CUresult r = need_ctx(); if (r) return r; *s = malloc(1); return OK; }
CUresult cuStreamDestroy_v2(CUstream s) { CUresult r = need_ctx(); if (r) return r; free(s); return OK; }
CUresult cuStreamSynchronize(CUstream s) { (void)s; return need_ctx(); }

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    CUresult r = need_ctx();
    if (r) return r;
    if (!n) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    if (used + n > TOTAL) { pthread_mutex_unlock(&lock); return OUT_OF_MEMORY; }
    size_t rounded = (n + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    void *m = aligned_alloc(2u << 20, rounded);
    int i;
    for (i = 0; i < MAX_RANGES && allocs[i].len; i++) {}
    if (!m || i == MAX_RANGES) { free(m); pthread_mutex_unlock(&lock); return OUT_OF_MEMORY; }
    allocs[i].start = (uintptr_t)m;
    allocs[i].len = n;
    used += n;
    pthread_mutex_unlock(&lock);
    *p = (CUdeviceptr)(uintptr_t)m;
    return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    CUresult r = need_ctx();
    if (r) return r;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_RANGES; i++)
        if (allocs[i].len && allocs[i].start == p) {
            used -= allocs[i].len;
            allocs[i].len = 0;
            pthread_mutex_unlock(&lock);
            free((void *)(uintptr_t)p);
            return OK;
        }
    pthread_mutex_unlock(&lock);
    return INVALID_VALUE;
}
static CUresult dev_ok(CUdeviceptr d, size_t n) {
    CUresult r = need_ctx();
    if (r) return r;
    pthread_mutex_lock(&lock);
    int i = find(allocs, (uintptr_t)d, n);
    pthread_mutex_unlock(&lock);
    return i < 0 ? INVALID_VALUE : OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, CUstream s) {
    (void)s; CUresult r = dev_ok(d, n); if (r) return r;
    memcpy((void *)(uintptr_t)d, h, n); return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, CUstream s) {
    (void)s; CUresult r = dev_ok(d, n); if (r) return r;
    memcpy(h, (void *)(uintptr_t)d, n); return OK;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { return cuMemcpyHtoDAsync_v2(d, h, n, 0); }
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { return cuMemcpyDtoHAsync_v2(h, d, n, 0); }
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    CUresult r = need_ctx();
    if (r) return r;
    pthread_mutex_lock(&lock);
    int i = find(allocs, (uintptr_t)p, 1);
    if (i >= 0) { *base = allocs[i].start; *size = allocs[i].len; }
    pthread_mutex_unlock(&lock);
    return i < 0 ? INVALID_VALUE : OK;
}

#ifndef STUB_MISSING_REGISTER
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
    CUresult r = need_ctx();
    if (r) return r;
    if (flags != 3) return INVALID_VALUE; /* kvnode asks for PORTABLE | DEVICEMAP */
    uintptr_t s = (uintptr_t)p;
    pthread_mutex_lock(&lock);
    int free_slot = -1;
    for (int i = 0; i < MAX_RANGES; i++) {
        struct range *g = &registered[i];
        if (!g->len) { if (free_slot < 0) free_slot = i; continue; }
        if (s < g->start + g->len && g->start < s + n) { pthread_mutex_unlock(&lock); return ALREADY_REGISTERED; }
    }
    if (free_slot < 0) { pthread_mutex_unlock(&lock); return OUT_OF_MEMORY; }
    registered[free_slot].start = s;
    registered[free_slot].len = n;
    pthread_mutex_unlock(&lock);
    return OK;
}
#endif
CUresult cuMemHostUnregister(void *p) {
    CUresult r = need_ctx();
    if (r) return r;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_RANGES; i++)
        if (registered[i].len && registered[i].start == (uintptr_t)p) {
            registered[i].len = 0;
            pthread_mutex_unlock(&lock);
            return OK;
        }
    pthread_mutex_unlock(&lock);
    return NOT_REGISTERED;
}

CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr d, size_t n, int type, unsigned long long flags) {
    (void)flags;
#ifndef STUB_DMABUF
    (void)handle; (void)d; (void)n; (void)type;
    return NOT_SUPPORTED;
#else
    /* Like the driver: the window must be host-page aligned and inside the allocation as the
     * driver backs it (sizes rounded up to 2 MiB), which may pass its nominal size. */
    CUresult r = need_ctx();
    if (r) return r;
    long page = sysconf(_SC_PAGESIZE);
    if (type != 1 || (d % page) || (n % page)) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int ok = 0;
    for (int i = 0; i < MAX_RANGES; i++) {
        size_t backed = (allocs[i].len + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
        if (allocs[i].len && d >= allocs[i].start && d + n <= allocs[i].start + backed) ok = 1;
    }
    pthread_mutex_unlock(&lock);
    if (!ok) return INVALID_VALUE;
    int fd = memfd_create("kvnode-stub-dmabuf", MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    *(int *)handle = fd;
    return OK;
#endif
}

/* Test hook (not a CUDA function): host ranges registered now. */
int kvnode_stub_registered_ranges(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_RANGES; i++) n += registered[i].len != 0;
    pthread_mutex_unlock(&lock);
    return n;
}
