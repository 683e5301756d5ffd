/*
 * The C side of the OFI transport (src/transport/ofi/): libfabric's calls are `static inline`
 * functions over its objects' operation tables, which Rust cannot call, and its few exported
 * functions (fi_getinfo, fi_fabric, ...) must not be linked, so that a build needs no
 * libfabric. This file compiles those inline calls against the vendored 1.17 headers
 * (include/rdma/) and resolves the exported functions from libfabric.so.1 with dlopen/dlsym at
 * run time. It keeps no state besides the loaded library; every object it opens is handed to
 * Rust in one `xofi_ep`, which Rust owns and closes.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

/* The API version asked of libfabric: that of the vendored headers. */
#define XOFI_API FI_VERSION(1, 17)

static struct {
    void *handle;
    int (*getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *, struct fi_info **);
    void (*freeinfo)(struct fi_info *);
    struct fi_info *(*dupinfo)(const struct fi_info *);
    int (*fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
    const char *(*strerror)(int);
    uint32_t (*version)(void);
} lib;

/* Loads `path` once (the caller serializes calls). 0, or -1 with the reason in `err`. */
int xofi_load(const char *path, char *err, size_t err_len) {
    if (lib.handle) return 0;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(err, err_len, "%s", dlerror());
        return -1;
    }
    struct { const char *name; void **slot; } symbols[] = {
        {"fi_getinfo", (void **)&lib.getinfo}, {"fi_freeinfo", (void **)&lib.freeinfo},
        {"fi_dupinfo", (void **)&lib.dupinfo}, {"fi_fabric", (void **)&lib.fabric},
        {"fi_strerror", (void **)&lib.strerror}, {"fi_version", (void **)&lib.version},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        *symbols[i].slot = dlsym(h, symbols[i].name);
        if (!*symbols[i].slot) {
            snprintf(err, err_len, "%s has no symbol %s", path, symbols[i].name);
            dlclose(h);
            memset(&lib, 0, sizeof lib);
            return -1;
        }
    }
    lib.handle = h;
    return 0;
}

uint32_t xofi_version(void) { return lib.version(); }

const char *xofi_strerror(int code) { return lib.strerror(code < 0 ? -code : code); }

/*
 * The providers that offer what the transport needs: reliable unconnected endpoints
 * (FI_EP_RDM) with tagged messages received from a named source, in send order between a
 * pair, without the caller registering its buffers (no FI_MR_LOCAL: the provider registers or
 * copies). `source`, if not NULL, is the address (or host name) the endpoint must use
 * (FI_SOURCE): on a host with a NIC per rank, the rank's own. libfabric itself applies
 * FI_PROVIDER. 0 and the list in `out`, or a negative libfabric error code (-FI_ENODATA: none
 * matches).
 */
int xofi_getinfo(const char *source, struct fi_info **out) {
    struct fi_info *hints = lib.dupinfo(NULL);
    if (!hints) return -FI_ENOMEM;
    hints->caps = FI_TAGGED | FI_DIRECTED_RECV | FI_SEND | FI_RECV;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->ep_attr->type = FI_EP_RDM;
    hints->tx_attr->msg_order = FI_ORDER_SAS;
    hints->rx_attr->msg_order = FI_ORDER_SAS;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->av_type = FI_AV_TABLE;
    int rc = lib.getinfo(XOFI_API, source, NULL, source ? FI_SOURCE : 0, hints, out);
    lib.freeinfo(hints);
    return rc;
}

void xofi_freeinfo(struct fi_info *info) { lib.freeinfo(info); }
const struct fi_info *xofi_info_next(const struct fi_info *info) { return info->next; }
const char *xofi_info_provider(const struct fi_info *info) {
    return info->fabric_attr && info->fabric_attr->prov_name ? info->fabric_attr->prov_name : "";
}
const char *xofi_info_domain(const struct fi_info *info) {
    return info->domain_attr && info->domain_attr->name ? info->domain_attr->name : "";
}
size_t xofi_info_max_msg_size(const struct fi_info *info) { return info->ep_attr->max_msg_size; }
size_t xofi_info_rx_size(const struct fi_info *info) { return info->rx_attr ? info->rx_attr->size : 0; }
uint64_t xofi_info_mem_tag_format(const struct fi_info *info) { return info->ep_attr->mem_tag_format; }

/* One endpoint and what it needs; Rust owns it (xofi_close). */
struct xofi_ep {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    int wait_fd; /* the CQ's file descriptor to poll, or -1 */
    uint64_t tag_mask; /* the bits a tag may have (the provider's width, or narrower) */
};

/* A tag outside the endpoint's mask: returned by a post instead of handing it to the provider. */
#define XOFI_EBADTAG 100000

void xofi_close(struct xofi_ep *e) {
    if (!e) return;
    if (e->ep) fi_close(&e->ep->fid);
    if (e->av) fi_close(&e->av->fid);
    if (e->cq) fi_close(&e->cq->fid);
    if (e->domain) fi_close(&e->domain->fid);
    if (e->fabric) fi_close(&e->fabric->fid);
    if (e->info) lib.freeinfo(e->info);
    free(e);
}

#define CHECK(call, what)                                                                   \
    do {                                                                                    \
        int rc_ = (call);                                                                   \
        if (rc_) {                                                                          \
            snprintf(err, err_len, "%s failed: %s (%d)", what, lib.strerror(-rc_), rc_);    \
            xofi_close(e);                                                                  \
            return NULL;                                                                    \
        }                                                                                   \
    } while (0)

/*
 * Opens an endpoint of `info` (one element of xofi_getinfo's list): fabric, domain, a tagged
 * completion queue with a file descriptor to wait on where the provider has one and `want_fd`
 * asks for it, a table address vector, the endpoint bound to both. NULL with the reason in
 * `err` on failure.
 */
struct xofi_ep *xofi_open(const struct fi_info *info, int want_fd, char *err, size_t err_len) {
    struct xofi_ep *e = calloc(1, sizeof *e);
    if (!e) {
        snprintf(err, err_len, "out of memory");
        return NULL;
    }
    e->wait_fd = -1;
    e->tag_mask = UINT64_MAX;
    e->info = lib.dupinfo(info);
    if (!e->info) {
        snprintf(err, err_len, "fi_dupinfo failed");
        xofi_close(e);
        return NULL;
    }
    e->info->next = NULL;
    CHECK(lib.fabric(e->info->fabric_attr, &e->fabric, NULL), "fi_fabric");
    CHECK(fi_domain(e->fabric, e->info, &e->domain, NULL), "fi_domain");
    struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_FD, .size = 0};
    if (want_fd && fi_cq_open(e->domain, &cq_attr, &e->cq, NULL) == 0) {
        if (fi_control(&e->cq->fid, FI_GETWAIT, &e->wait_fd) != 0) e->wait_fd = -1;
    } else {
        /* No file descriptor (efa refuses FI_WAIT_FD): the transport busy-polls the queue. */
        cq_attr.wait_obj = FI_WAIT_NONE;
        CHECK(fi_cq_open(e->domain, &cq_attr, &e->cq, NULL), "fi_cq_open");
    }
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    CHECK(fi_av_open(e->domain, &av_attr, &e->av, NULL), "fi_av_open");
    CHECK(fi_endpoint(e->domain, e->info, &e->ep, NULL), "fi_endpoint");
    CHECK(fi_ep_bind(e->ep, &e->cq->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    CHECK(fi_ep_bind(e->ep, &e->av->fid, 0), "fi_ep_bind(av)");
    CHECK(fi_enable(e->ep), "fi_enable");
    return e;
}

int xofi_wait_fd(const struct xofi_ep *e) { return e->wait_fd; }

/* Whether the provider moves data only when the queue is read (FI_PROGRESS_MANUAL). */
int xofi_manual_progress(const struct xofi_ep *e) { return e->info->domain_attr->data_progress == FI_PROGRESS_MANUAL; }

/* This endpoint's address into `buf` (`*len` its size in, the address's out). */
int xofi_name(struct xofi_ep *e, void *buf, size_t *len) { return fi_getname(&e->ep->fid, buf, len); }

/* Inserts one peer address; 0 and its handle in `out`, or a negative error code. */
int xofi_av_insert(struct xofi_ep *e, const void *addr, uint64_t *out) {
    fi_addr_t a = FI_ADDR_UNSPEC;
    int n = fi_av_insert(e->av, addr, 1, &a, 0, NULL);
    if (n < 0) return n;
    if (n != 1) return -FI_EINVAL;
    *out = a;
    return 0;
}

/* Sets the bits a tag may have; every post checks its tag against them, so that no tag the
 * provider would refuse (cxi: -FI_EINVAL past 48 bits) or truncate reaches it. */
void xofi_set_tag_mask(struct xofi_ep *e, uint64_t mask) { e->tag_mask = mask; }

/* Posts a tagged send/receive; `context` (FI_CONTEXT2's 64 bytes, kept by the caller until the
 * completion) comes back in it. 0, -FI_EAGAIN (progress and retry), -XOFI_EBADTAG (a tag or
 * ignore mask outside the endpoint's mask: never posted) or another error. */
long xofi_tsend(struct xofi_ep *e, const void *buf, size_t len, uint64_t dest, uint64_t tag, void *context) {
    if (tag & ~e->tag_mask) return -XOFI_EBADTAG;
    return fi_tsend(e->ep, buf, len, NULL, dest, tag, context);
}
long xofi_trecv(struct xofi_ep *e, void *buf, size_t len, uint64_t src, uint64_t tag, uint64_t ignore, void *context) {
    if ((tag | ignore) & ~e->tag_mask) return -XOFI_EBADTAG;
    return fi_trecv(e->ep, buf, len, NULL, src, tag, ignore, context);
}
int xofi_cancel(struct xofi_ep *e, void *context) { return (int)fi_cancel(&e->ep->fid, context); }

/* One completion, successful (err 0) or failed (err a positive libfabric error code). */
struct xofi_completion {
    void *context;
    uint64_t len;
    uint64_t tag;
    uint64_t olen; /* bytes the sender had beyond the receive buffer (err FI_ETRUNC) */
    int32_t err;
    int32_t prov_errno;
};

/*
 * Reads up to `max` completions (driving the provider's progress). The count (0: none yet), or a
 * negative error code. A failed operation is returned alone, as one completion with `err` set.
 */
int xofi_poll(struct xofi_ep *e, struct xofi_completion *out, int max) {
    struct fi_cq_tagged_entry entries[32];
    if (max > 32) max = 32;
    ssize_t n = fi_cq_read(e->cq, entries, (size_t)max);
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry ee;
        memset(&ee, 0, sizeof ee);
        ssize_t r = fi_cq_readerr(e->cq, &ee, 0);
        if (r == -FI_EAGAIN) return 0;
        if (r < 0) return (int)r;
        out[0] = (struct xofi_completion){ee.op_context, ee.len, ee.tag, ee.olen, ee.err ? ee.err : FI_EOTHER, ee.prov_errno};
        return 1;
    }
    if (n < 0) return (int)n;
    for (ssize_t i = 0; i < n; i++) {
        out[i] = (struct xofi_completion){entries[i].op_context, entries[i].len, entries[i].tag, 0, 0, 0};
    }
    return (int)n;
}

/* 0 when the caller may sleep on the wait descriptor, else it must read the queue first. */
int xofi_trywait(struct xofi_ep *e) {
    struct fid *fids[1] = {&e->cq->fid};
    return fi_trywait(e->fabric, fids, 1);
}
