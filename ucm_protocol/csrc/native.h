/*
 * The compiled helper's shared declarations (ucm_protocol._native; the sources are split by job:
 * table.c the presence table, ring.c the ring's words and request bodies, blocks.c copies and
 * checksums, index.c a snapshot's keys into a dict, module.c the module). Layout constants mirror
 * ucm_protocol/dataplane.py; a test compares them (``layout()``).
 */
#ifndef UCM_NATIVE_H
#define UCM_NATIVE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* Presence table layout: mirrors ucm_protocol/dataplane.py (tests compare them). */
#define T_VERSION 8
#define T_SEED 24
#define T_NSLOTS 32
#define T_SLOTS_AT 40
#define T_NS_CAPACITY 48
#define T_NS_COUNT 52
#define T_STATE 56
#define T_FLAGS 60
#define T_VALID_UNTIL 64
#define T_LIVE 72
#define T_USED 80
#define T_DIR_AT 88
#define T_MAX_KEYS 96
#define HEADER_MIN 104
#define SLOT_BYTES 40
#define DIR_ENTRY_BYTES 32
#define TAG_DELETED 0xFFFFu /* a slot's tag: 0 empty, this deleted, else the namespace id + 1 */
#define MAX_TAG 0xFFFEu
#define MAX_TIERS 16
#define MAX_PROBE 64
#define SEQ_RETRIES 4096
#define PREFETCH_AHEAD 16
#define TABLE_LIVE 0
#define NS_NONE 0xFFFFFFFEu /* table_lookup: a namespace with nothing stored (every key absent) */
#define FLAG_COMPLETE 1u
#define DIR_TRACKED 2u
#define DIR_POPULATING 1u

/* A slot as stored: the tag in the low 16 bits of ``tt``, the tiers holding the key in the high 16. */
typedef struct {
    uint32_t seq;
    uint32_t tt;
    uint64_t d[4];
} slot_t;

/* A slot as read: one consistent copy. */
typedef struct {
    uint32_t tag;
    uint32_t tiers;
    uint64_t d[4];
} entry_t;

#define TT(tag, tiers) ((uint32_t)(tag) | ((uint32_t)(tiers) << 16))
#define TAG_OF(tt) ((tt) & 0xFFFFu)
#define TIERS_OF(tt) ((tt) >> 16)

typedef struct {
    char *base;
    Py_ssize_t len;
    char *slots;
    uint64_t nslots;
    uint64_t seed;
    char *dir;
    uint32_t ns_capacity;
} table_t;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline uint64_t rd64(const char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t rd32(const char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t fmix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static inline uint64_t slot_hash(uint64_t seed, uint32_t tag, const uint64_t d[4]) {
    return fmix64(d[0] ^ seed ^ ((uint64_t)tag * 0x9E3779B97F4A7C15ULL)) ^ fmix64(d[1] + seed);
}

static inline uint64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

PyObject *ucm_table_read_slot(PyObject *self, PyObject *args);
PyObject *ucm_table_lookup(PyObject *self, PyObject *args);
PyObject *ucm_table_find_ns(PyObject *self, PyObject *args);
PyObject *ucm_table_set(PyObject *self, PyObject *args);
PyObject *ucm_table_apply(PyObject *self, PyObject *args);
PyObject *ucm_table_clear_bit(PyObject *self, PyObject *args);
PyObject *ucm_table_copy(PyObject *self, PyObject *args);
PyObject *ucm_load_u32(PyObject *self, PyObject *args);
PyObject *ucm_load_u64(PyObject *self, PyObject *args);
PyObject *ucm_store_u32(PyObject *self, PyObject *args);
PyObject *ucm_store_u64(PyObject *self, PyObject *args);
PyObject *ucm_add_u64(PyObject *self, PyObject *args);
PyObject *ucm_encode_batch(PyObject *self, PyObject *args);
int ucm_ring_init(void);
PyObject *ucm_copy_pairs(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *ucm_copy_spans(PyObject *self, PyObject *args, PyObject *kwargs);
#ifdef UCM_HAVE_XXHASH
PyObject *ucm_xxh3_64(PyObject *self, PyObject *args);
PyObject *ucm_xxh3_64_many(PyObject *self, PyObject *args);
PyObject *ucm_read_records(PyObject *self, PyObject *args);
#endif
PyObject *ucm_index_keys(PyObject *self, PyObject *args);
PyObject *ucm_index_fill(PyObject *self, PyObject *args);
PyObject *ucm_block_keys(PyObject *self, PyObject *args);

extern const char ucm_table_read_slot_doc[], ucm_table_lookup_doc[], ucm_table_find_ns_doc[], ucm_table_set_doc[],
    ucm_table_apply_doc[], ucm_table_clear_bit_doc[], ucm_table_copy_doc[], ucm_encode_batch_doc[],
    ucm_copy_pairs_doc[], ucm_copy_spans_doc[], ucm_xxh3_64_doc[], ucm_xxh3_64_many_doc[], ucm_read_records_doc[], ucm_index_keys_doc[], ucm_index_fill_doc[],
    ucm_block_keys_doc[];

#endif
