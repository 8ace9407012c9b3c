/*
 * ucm_protocol._native: the data plane's per-key and per-block loops, compiled.
 *
 * The local data plane (ucm_protocol/dataplane.py describes the layouts) shares memory between the
 * daemon and its clients. Two things there need machine code: ordering (a reader of the presence
 * table must never take a half-written slot for a whole one, which takes acquire/release ordering
 * that Python cannot express), and speed (2,048 probes or 4,096 block descriptions per call, where a
 * Python step per key costs more than the gRPC round trip the data plane replaces).
 *
 * Nothing here trusts the memory it reads: every offset and count taken from a table or a ring is
 * bounds-checked against the buffer first. The daemon's writers run on its event-loop thread only
 * (one writer per table); readers may be any number of threads in any number of processes.
 *
 * Built by setuptools (`pip install -e .`, setup.py) as an optional extension: without a C compiler
 * the package installs without it and the data plane is off (clients use gRPC, as before).
 */
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
#define SLOT_BYTES 48
#define DIR_ENTRY_BYTES 32
#define TAG_DELETED 0xFFFFFFFFu
#define MAX_PROBE 64
#define SEQ_RETRIES 4096
#define PREFETCH_AHEAD 16
#define TABLE_LIVE 0
#define NS_NONE 0xFFFFFFFEu /* table_lookup: a namespace with nothing stored (every key absent) */
#define FLAG_COMPLETE 1u
#define DIR_TRACKED 2u
#define DIR_POPULATING 1u

typedef struct {
    uint32_t seq;
    uint32_t tag;
    uint32_t tiers;
    uint32_t pad;
    uint64_t d[4];
} slot_t;

typedef struct {
    char *base;
    Py_ssize_t len;
    char *slots;
    uint64_t nslots;
    uint64_t mask;
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

static uint64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* The table's geometry from its header, checked against the buffer; -1 (ValueError set) if bad. */
static int table_open(Py_buffer *view, table_t *t) {
    char *b = (char *)view->buf;
    t->base = b;
    t->len = view->len;
    if (view->len < HEADER_MIN) goto bad;
    uint64_t nslots = rd64(b + T_NSLOTS), slots_at = rd64(b + T_SLOTS_AT), dir_at = rd64(b + T_DIR_AT);
    uint32_t cap = rd32(b + T_NS_CAPACITY);
    if (nslots == 0 || (nslots & (nslots - 1)) != 0 || nslots > ((uint64_t)1 << 40)) goto bad;
    if (slots_at % 64 != 0 || dir_at % 8 != 0) goto bad;
    if (slots_at > (uint64_t)view->len || nslots > ((uint64_t)view->len - slots_at) / SLOT_BYTES) goto bad;
    if (dir_at > (uint64_t)view->len || (uint64_t)cap > ((uint64_t)view->len - dir_at) / DIR_ENTRY_BYTES) goto bad;
    t->slots = b + slots_at;
    t->nslots = nslots;
    t->mask = nslots - 1;
    t->seed = rd64(b + T_SEED);
    t->dir = b + dir_at;
    t->ns_capacity = cap;
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "not a presence table (its header does not fit the memory)");
    return -1;
}

static inline slot_t *slot_at(const table_t *t, uint64_t i) {
    return (slot_t *)(t->slots + (i & t->mask) * SLOT_BYTES);
}

/* ---- readers (any process, any thread) --------------------------------------------------------- */

/* A consistent copy of one slot (the sequence lock's read side); -1 if it kept changing. */
static int slot_read(slot_t *s, slot_t *copy) {
    for (int tries = 0; tries <= SEQ_RETRIES; tries++) {
        uint32_t s1 = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
        if (s1 & 1u) {
            cpu_relax();
            continue;
        }
        copy->tag = __atomic_load_n(&s->tag, __ATOMIC_RELAXED);
        copy->tiers = __atomic_load_n(&s->tiers, __ATOMIC_RELAXED);
        for (int i = 0; i < 4; i++) copy->d[i] = __atomic_load_n(&s->d[i], __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&s->seq, __ATOMIC_RELAXED) == s1) {
            copy->seq = s1;
            return 0;
        }
    }
    return -1;
}

/* 1 present, 0 absent, -1 cannot tell (probe bound reached, or a slot kept changing). ``h``: the
key's hash (computed ahead, so its first slot could be prefetched). */
static int probe_read(const table_t *t, uint32_t tag, const uint64_t d[4], uint64_t h) {
    for (uint64_t i = 0; i < MAX_PROBE && i < t->nslots; i++) {
        slot_t c;
        if (slot_read(slot_at(t, h + i), &c) < 0) return -1;
        if (c.tag == 0) return 0;
        if (c.tag == tag && c.d[0] == d[0] && c.d[1] == d[1] && c.d[2] == d[2] && c.d[3] == d[3]) return c.tiers != 0;
    }
    return -1;
}

PyDoc_STRVAR(table_read_slot_doc,
"table_read_slot(table, index) -> (tag, tiers, digest) | None\n\n"
"What a reader sees in slot ``index``: one consistent copy, or None if it kept changing.");

static PyObject *table_read_slot(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long long index;
    if (!PyArg_ParseTuple(args, "y*K", &view, &index)) return NULL;
    PyObject *result = NULL;
    table_t t;
    if (table_open(&view, &t) == 0) {
        if (index >= t.nslots) {
            PyErr_SetString(PyExc_IndexError, "slot index out of range");
        } else {
            slot_t c;
            int r;
            Py_BEGIN_ALLOW_THREADS
            r = slot_read(slot_at(&t, index), &c);
            Py_END_ALLOW_THREADS
            if (r < 0)
                result = Py_NewRef(Py_None);
            else
                result = Py_BuildValue("(kky#)", (unsigned long)c.tag, (unsigned long)c.tiers, (const char *)c.d, (Py_ssize_t)32);
        }
    }
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(table_lookup_doc,
"table_lookup(table, ns_id, keys, out) -> int\n\n"
"Presence of each 32-byte key of namespace ``ns_id``, one byte (0/1) per key into ``out``. Returns\n"
"the number of leading keys present (``ns_id`` NS_NONE: a namespace the directory of a table of every\n"
"namespace does not list: nothing of it is stored), or: -1 the table cannot answer (a key whose probe ran out, or\n"
"an incomplete table missing a key: ask the daemon), -2 a key is not 32 bytes of ``bytes`` (the\n"
"daemon names it), -3 the table is stale (superseded, closed, or its validity has passed).");

static PyObject *table_lookup(PyObject *self, PyObject *args) {
    Py_buffer view, out;
    unsigned int ns_id;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "y*IOw*", &view, &ns_id, &keys, &out)) return NULL;
    PyObject *result = NULL;
    uint64_t *digests = NULL;
    table_t t;
    if (table_open(&view, &t) < 0) goto done;
    if (!PyList_Check(keys) && !PyTuple_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list or tuple of bytes");
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (out.len < n) {
        PyErr_SetString(PyExc_ValueError, "out is shorter than keys");
        goto done;
    }
    if (ns_id > NS_NONE) {
        PyErr_SetString(PyExc_ValueError, "ns_id out of range");
        goto done;
    }
    digests = PyMem_Malloc(n > 0 ? (size_t)n * 32 : 1);
    if (digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = items[i];
        if (!PyBytes_CheckExact(k) || PyBytes_GET_SIZE(k) != 32) {
            result = PyLong_FromLong(-2);
            goto done;
        }
        memcpy(digests + 4 * i, PyBytes_AS_STRING(k), 32);
    }
    long code;
    uint32_t tag = ns_id + 1;
    if ((uint64_t)n > rd64(t.base + T_MAX_KEYS)) {
        result = PyLong_FromLong(-1); /* past the daemon's limit: gRPC says so */
        goto done;
    }
    char *o = (char *)out.buf;
    Py_BEGIN_ALLOW_THREADS /* the keys were copied above: nothing below touches a Python object */
    {
        char *b = t.base;
        uint32_t state = __atomic_load_n((uint32_t *)(b + T_STATE), __ATOMIC_ACQUIRE);
        uint64_t valid = __atomic_load_n((uint64_t *)(b + T_VALID_UNTIL), __ATOMIC_ACQUIRE);
        uint32_t flags = __atomic_load_n((uint32_t *)(b + T_FLAGS), __ATOMIC_ACQUIRE);
        if (state != TABLE_LIVE || valid <= monotonic_ns()) {
            code = -3;
        } else {
            Py_ssize_t prefix = -1;
            int unknown = 0, missing = 0;
            uint64_t ahead[PREFETCH_AHEAD];
            /* Hash a few keys ahead and prefetch their first slots: their cache misses overlap. */
            for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) {
                ahead[i] = slot_hash(t.seed, tag, digests + 4 * i);
                __builtin_prefetch(slot_at(&t, ahead[i]), 0, 0);
            }
            for (Py_ssize_t i = 0; i < n; i++) {
                uint64_t h = ahead[i % PREFETCH_AHEAD];
                Py_ssize_t next = i + PREFETCH_AHEAD;
                if (next < n) {
                    ahead[next % PREFETCH_AHEAD] = slot_hash(t.seed, tag, digests + 4 * next);
                    __builtin_prefetch(slot_at(&t, ahead[next % PREFETCH_AHEAD]), 0, 0);
                }
                int r = ns_id == NS_NONE ? 0 : probe_read(&t, tag, digests + 4 * i, h);
                if (r < 0) {
                    unknown = 1;
                    break;
                }
                o[i] = (char)r;
                if (!r) {
                    missing = 1;
                    if (prefix < 0) prefix = i;
                }
            }
            if (unknown || (missing && !(flags & FLAG_COMPLETE)))
                code = -1;
            else
                code = prefix < 0 ? (long)n : (long)prefix;
            /* still valid after the reads: a table superseded meanwhile may have missed changes */
            if (code >= 0 && __atomic_load_n((uint32_t *)(b + T_STATE), __ATOMIC_ACQUIRE) != TABLE_LIVE) code = -3;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(code);
done:
    PyMem_Free(digests);
    PyBuffer_Release(&view);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(table_find_ns_doc,
"table_find_ns(table, namespace) -> int\n\n"
"The directory id of a tracked ``namespace`` (16 bytes); -1 if it is not in the directory, -2 while\n"
"the daemon is still filling it in.");

static PyObject *table_find_ns(PyObject *self, PyObject *args) {
    Py_buffer view;
    const char *ns;
    Py_ssize_t ns_len;
    if (!PyArg_ParseTuple(args, "y*y#", &view, &ns, &ns_len)) return NULL;
    long found = -1;
    table_t t;
    if (table_open(&view, &t) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (ns_len == 16) {
        uint32_t count = __atomic_load_n((uint32_t *)(t.base + T_NS_COUNT), __ATOMIC_ACQUIRE);
        if (count > t.ns_capacity) count = t.ns_capacity;
        for (uint32_t i = 0; i < count; i++) {
            char *e = t.dir + (uint64_t)i * DIR_ENTRY_BYTES;
            uint32_t state = __atomic_load_n((uint32_t *)(e + 16), __ATOMIC_ACQUIRE);
            if (state != DIR_TRACKED && state != DIR_POPULATING) continue;
            if (memcmp(e, ns, 16) == 0) {
                found = state == DIR_TRACKED ? (long)i : -2;
                break;
            }
        }
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(found);
}

/* ---- the writer (the daemon's event-loop thread) ----------------------------------------------- */

static void slot_store(slot_t *s, uint32_t tag, uint32_t tiers, const uint64_t d[4]) {
    uint32_t q = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
    if (q & 1u) q++; /* never leave a slot odd (a table built by someone else) */
    __atomic_store_n(&s->seq, q + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&s->tag, tag, __ATOMIC_RELAXED);
    __atomic_store_n(&s->tiers, tiers, __ATOMIC_RELAXED);
    for (int i = 0; i < 4; i++) __atomic_store_n(&s->d[i], d[i], __ATOMIC_RELAXED);
    __atomic_store_n(&s->seq, q + 2, __ATOMIC_RELEASE);
}

static void count_add(table_t *t, int off, int64_t delta) {
    uint64_t *p = (uint64_t *)(t->base + off);
    __atomic_store_n(p, __atomic_load_n(p, __ATOMIC_RELAXED) + (uint64_t)delta, __ATOMIC_RELAXED);
}

/* The slot holding the key, or NULL; *free: the first deleted or empty slot on the way (NULL if none). */
static slot_t *probe_write(const table_t *t, uint32_t tag, const uint64_t d[4], slot_t **free) {
    uint64_t h = slot_hash(t->seed, tag, d);
    *free = NULL;
    for (uint64_t i = 0; i < MAX_PROBE && i < t->nslots; i++) {
        slot_t *s = slot_at(t, h + i);
        if (s->tag == 0) {
            if (*free == NULL) *free = s;
            return NULL;
        }
        if (s->tag == TAG_DELETED) {
            if (*free == NULL) *free = s;
            continue;
        }
        if (s->tag == tag && memcmp(s->d, d, 32) == 0) return s;
    }
    return NULL;
}

/* Slots in use (entries and deleted ones) past three quarters: time to rebuild. */
static inline int crowded(const table_t *t) {
    uint64_t used = __atomic_load_n((uint64_t *)(t->base + T_USED), __ATOMIC_RELAXED);
    return used > t->nslots - t->nslots / 4;
}

/* Set (on) or clear a tier bit of one key: 1 changed, 0 nothing to do, -1 no slot within reach. */
static int key_update(table_t *t, uint32_t tag, const uint64_t d[4], uint32_t bit, int on) {
    slot_t *free;
    slot_t *s = probe_write(t, tag, d, &free);
    if (on) {
        if (s != NULL) {
            if (s->tiers & bit) return 0;
            slot_store(s, tag, s->tiers | bit, d);
            return 1;
        }
        if (free == NULL) return -1;
        if (free->tag == 0) count_add(t, T_USED, 1);
        slot_store(free, tag, bit, d);
        count_add(t, T_LIVE, 1);
        return 1;
    }
    if (s == NULL || !(s->tiers & bit)) return 0;
    uint32_t left = s->tiers & ~bit;
    if (left) {
        slot_store(s, tag, left, d);
    } else {
        static const uint64_t zero[4] = {0, 0, 0, 0};
        slot_store(s, TAG_DELETED, 0, zero);
        count_add(t, T_LIVE, -1);
    }
    return 1;
}

PyDoc_STRVAR(table_apply_doc,
"table_apply(table, keys, ns_ids, bit, on) -> (done, unknown_namespaces, crowded)\n\n"
"Set (``on``) or clear tier ``bit`` for each 48-byte key (namespace + digest) whose namespace is in\n"
"``ns_ids`` (namespace -> directory id); keys of other namespaces are skipped and their namespaces\n"
"returned. ``done`` < len(keys): the key at that index found no slot within reach (rebuild the\n"
"table, then apply the rest); ``crowded``: rebuild it soon.");

PyDoc_STRVAR(table_set_doc,
"table_set(table, key, ns_ids, bit, on) -> int\n\n"
"``table_apply`` for one key, without building a list or a tuple (an index change costs this call):\n"
"0 nothing changed, 1 changed, 2 changed and the table is crowded, -1 no slot within reach, -2 the\n"
"key's namespace is not in ``ns_ids``.");

static PyObject *table_set(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *key, *ns_ids;
    unsigned int bit;
    int on;
    if (!PyArg_ParseTuple(args, "w*OO!Ip", &view, &key, &PyDict_Type, &ns_ids, &bit, &on)) return NULL;
    PyObject *result = NULL;
    table_t t;
    char *kb;
    Py_ssize_t klen;
    if (table_open(&view, &t) < 0 || PyBytes_AsStringAndSize(key, &kb, &klen) < 0) goto done;
    if (klen != 48 || bit == 0 || (bit & (bit - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "a 48-byte key and a single bit expected");
        goto done;
    }
    PyObject *ns = PyBytes_FromStringAndSize(kb, 16);
    if (ns == NULL) goto done;
    PyObject *id = PyDict_GetItemWithError(ns_ids, ns);
    Py_DECREF(ns);
    if (id == NULL) {
        if (!PyErr_Occurred()) result = PyLong_FromLong(-2);
        goto done;
    }
    long v = PyLong_AsLong(id);
    if (v < 0 || v >= 0xFFFFFFFEL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "directory id out of range");
        goto done;
    }
    uint64_t d[4];
    memcpy(d, kb + 16, 32);
    int r = key_update(&t, (uint32_t)v + 1, d, bit, on);
    result = PyLong_FromLong(r > 0 && crowded(&t) ? 2 : r);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyObject *table_apply(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *keys, *ns_ids;
    unsigned int bit;
    int on;
    if (!PyArg_ParseTuple(args, "w*OO!Ip", &view, &keys, &PyDict_Type, &ns_ids, &bit, &on)) return NULL;
    PyObject *result = NULL, *unknown = NULL, *seq = NULL;
    table_t t;
    if (table_open(&view, &t) < 0) goto done;
    if (bit == 0 || (bit & (bit - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "bit must be a single bit");
        goto done;
    }
    seq = PySequence_Fast(keys, "keys must be a sequence of 48-byte keys");
    if (seq == NULL) goto done;
    unknown = PySet_New(NULL);
    if (unknown == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    char last_ns[16];
    long last_id = -2; /* -2: no namespace looked up yet, -1: the last one is unknown */
    for (i = 0; i < n; i++) {
        char *kb;
        Py_ssize_t klen;
        if (PyBytes_AsStringAndSize(items[i], &kb, &klen) < 0) goto done;
        if (klen != 48) {
            PyErr_Format(PyExc_ValueError, "key %zd is %zd bytes, not 48", i, klen);
            goto done;
        }
        if (last_id == -2 || memcmp(last_ns, kb, 16) != 0) {
            memcpy(last_ns, kb, 16);
            PyObject *ns = PyBytes_FromStringAndSize(kb, 16);
            if (ns == NULL) goto done;
            PyObject *id = PyDict_GetItemWithError(ns_ids, ns);
            if (id == NULL) {
                if (PyErr_Occurred() || PySet_Add(unknown, ns) < 0) {
                    Py_DECREF(ns);
                    goto done;
                }
                last_id = -1;
            } else {
                long v = PyLong_AsLong(id);
                if (v < 0 || v >= 0xFFFFFFFEL) {
                    Py_DECREF(ns);
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "directory id out of range");
                    goto done;
                }
                last_id = v;
            }
            Py_DECREF(ns);
        }
        if (last_id < 0) continue;
        uint64_t d[4];
        memcpy(d, kb + 16, 32);
        if (key_update(&t, (uint32_t)last_id + 1, d, bit, on) < 0) break;
    }
    result = Py_BuildValue("(nOO)", i, unknown, crowded(&t) ? Py_True : Py_False);
done:
    Py_XDECREF(seq);
    Py_XDECREF(unknown);
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(table_clear_bit_doc,
"table_clear_bit(table, bit) -> int\n\nClear tier ``bit`` in every slot (a tier that lost everything); the slots changed.");

static PyObject *table_clear_bit(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int bit;
    if (!PyArg_ParseTuple(args, "w*I", &view, &bit)) return NULL;
    table_t t;
    if (table_open(&view, &t) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    long changed = 0;
    for (uint64_t i = 0; i < t.nslots; i++) {
        slot_t *s = slot_at(&t, i);
        if (s->tag == 0 || s->tag == TAG_DELETED || !(s->tiers & bit)) continue;
        uint64_t d[4];
        memcpy(d, s->d, 32);
        key_update(&t, s->tag, d, bit, 0);
        changed++;
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(changed);
}

PyDoc_STRVAR(table_copy_doc,
"table_copy(src, dst) -> int\n\nInsert every entry of ``src`` into the empty table ``dst`` (a rebuild);\n"
"the entries copied, or -1 if ``dst`` had no slot within reach for one (make it larger).");

static PyObject *table_copy(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dst)) return NULL;
    PyObject *result = NULL;
    table_t a, b;
    if (table_open(&src, &a) < 0 || table_open(&dst, &b) < 0) goto done;
    long copied = 0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (uint64_t i = 0; i < a.nslots && !failed; i++) {
        slot_t *s = slot_at(&a, i);
        if (s->tag == 0 || s->tag == TAG_DELETED || s->tiers == 0) continue;
        slot_t *free;
        if (probe_write(&b, s->tag, s->d, &free) != NULL) continue;
        if (free == NULL) {
            failed = 1;
            break;
        }
        if (free->tag == 0) count_add(&b, T_USED, 1);
        slot_store(free, s->tag, s->tiers, s->d);
        count_add(&b, T_LIVE, 1);
        copied++;
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(failed ? -1 : copied);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* ---- ordered loads and stores of ring indices and header words --------------------------------- */

static int word_at(Py_buffer *view, Py_ssize_t off, Py_ssize_t size) {
    if (off < 0 || off % size != 0 || off > view->len - size || ((uintptr_t)view->buf % size) != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not an aligned word of a %zd-byte buffer", off, view->len);
        return -1;
    }
    return 0;
}

static PyObject *load_u32(PyObject *self, PyObject *args) {
    Py_buffer v;
    Py_ssize_t off;
    if (!PyArg_ParseTuple(args, "y*n", &v, &off)) return NULL;
    PyObject *r = NULL;
    if (word_at(&v, off, 4) == 0)
        r = PyLong_FromUnsignedLong(__atomic_load_n((uint32_t *)((char *)v.buf + off), __ATOMIC_ACQUIRE));
    PyBuffer_Release(&v);
    return r;
}

static PyObject *load_u64(PyObject *self, PyObject *args) {
    Py_buffer v;
    Py_ssize_t off;
    if (!PyArg_ParseTuple(args, "y*n", &v, &off)) return NULL;
    PyObject *r = NULL;
    if (word_at(&v, off, 8) == 0)
        r = PyLong_FromUnsignedLongLong(__atomic_load_n((uint64_t *)((char *)v.buf + off), __ATOMIC_ACQUIRE));
    PyBuffer_Release(&v);
    return r;
}

static PyObject *store_u32(PyObject *self, PyObject *args) {
    Py_buffer v;
    Py_ssize_t off;
    unsigned long long value;
    if (!PyArg_ParseTuple(args, "w*nK", &v, &off, &value)) return NULL;
    PyObject *r = NULL;
    if (word_at(&v, off, 4) == 0) {
        __atomic_store_n((uint32_t *)((char *)v.buf + off), (uint32_t)value, __ATOMIC_RELEASE);
        r = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&v);
    return r;
}

static PyObject *store_u64(PyObject *self, PyObject *args) {
    Py_buffer v;
    Py_ssize_t off;
    unsigned long long value;
    if (!PyArg_ParseTuple(args, "w*nK", &v, &off, &value)) return NULL;
    PyObject *r = NULL;
    if (word_at(&v, off, 8) == 0) {
        __atomic_store_n((uint64_t *)((char *)v.buf + off), (uint64_t)value, __ATOMIC_RELEASE);
        r = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&v);
    return r;
}

static PyObject *add_u64(PyObject *self, PyObject *args) {
    Py_buffer v;
    Py_ssize_t off;
    unsigned long long value;
    if (!PyArg_ParseTuple(args, "w*nK", &v, &off, &value)) return NULL;
    PyObject *r = NULL;
    if (word_at(&v, off, 8) == 0) {
        __atomic_fetch_add((uint64_t *)((char *)v.buf + off), (uint64_t)value, __ATOMIC_RELEASE);
        r = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&v);
    return r;
}

/* ---- a Load/Dump body, written by the client into its ring's arena ------------------------------ */

static PyObject *s_key, *s_segments, *s_region, *s_offset, *s_length;

static int seq_items(PyObject *o, Py_ssize_t *n, PyObject ***items) {
    if (PyTuple_Check(o)) {
        *n = PyTuple_GET_SIZE(o);
        *items = &PyTuple_GET_ITEM(o, 0);
        return 0;
    }
    if (PyList_Check(o)) {
        *n = PyList_GET_SIZE(o);
        *items = ((PyListObject *)o)->ob_item;
        return 0;
    }
    return -1;
}

static int u64_attr(PyObject *o, PyObject *name, uint64_t *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    if (!PyLong_CheckExact(v)) {
        Py_DECREF(v);
        return -1;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)x;
    return 0;
}

PyDoc_STRVAR(encode_batch_doc,
"encode_batch(arena, offset, limit, namespace, blocks, server_ids) -> (nbytes, nblocks, nsegments, multi) | None\n\n"
"Write a Load/Dump body (ucm_protocol.dataplane.body_bytes) for ``blocks`` (BlockIO objects) at\n"
"``offset`` of ``arena``, ending before ``limit``; ``server_ids``: region handle -> the daemon's id.\n"
"None when anything is not exactly as expected (a key not 32 bytes of bytes, a handle not in\n"
"``server_ids``, a field that is not an int in [0, 2**64), no room): the caller then builds the\n"
"request the checked way, whose errors name the culprit.");

static PyObject *encode_batch(PyObject *self, PyObject *args) {
    Py_buffer arena;
    Py_ssize_t offset, limit;
    const char *ns;
    Py_ssize_t ns_len;
    PyObject *blocks, *ids;
    if (!PyArg_ParseTuple(args, "w*nny#OO!", &arena, &offset, &limit, &ns, &ns_len, &blocks, &PyDict_Type, &ids))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t nblocks, nseg = 0;
    PyObject **bitems;
    int multi = 0;
    if (ns_len != 16 || seq_items(blocks, &nblocks, &bitems) < 0 || nblocks == 0) goto none;
    if (offset < 0 || limit > arena.len || offset > limit || offset % 8 != 0) goto none;
    /* pass 1: count segments */
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        PyObject *segs = PyObject_GetAttr(bitems[i], s_segments);
        if (segs == NULL) goto none;
        Py_ssize_t m;
        PyObject **sitems;
        int bad = seq_items(segs, &m, &sitems) < 0;
        Py_DECREF(segs);
        if (bad) goto none;
        if (m != 1) multi = 1;
        nseg += m;
    }
    Py_ssize_t counts_bytes = multi ? ((4 * nblocks + 7) & ~(Py_ssize_t)7) : 0;
    Py_ssize_t total = 16 + 32 * nblocks + counts_bytes + 24 * nseg;
    if (total > limit - offset) goto none;
    char *base = (char *)arena.buf + offset;
    char *keys = base + 16;
    char *counts = keys + 32 * nblocks;
    char *regions = counts + counts_bytes;
    char *offsets = regions + 8 * nseg;
    char *lengths = offsets + 8 * nseg;
    memcpy(base, ns, 16);
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        PyObject *block = bitems[i];
        PyObject *key = PyObject_GetAttr(block, s_key);
        if (key == NULL) goto none;
        int bad = !PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != 32;
        if (!bad) memcpy(keys + 32 * i, PyBytes_AS_STRING(key), 32);
        Py_DECREF(key);
        if (bad) goto none;
        PyObject *segs = PyObject_GetAttr(block, s_segments);
        if (segs == NULL) goto none;
        Py_ssize_t m;
        PyObject **sitems;
        if (seq_items(segs, &m, &sitems) < 0 || j + m > nseg) {
            Py_DECREF(segs);
            goto none;
        }
        if (multi) {
            uint32_t c = (uint32_t)m;
            if ((Py_ssize_t)c != m) {
                Py_DECREF(segs);
                goto none;
            }
            memcpy(counts + 4 * i, &c, 4);
        }
        for (Py_ssize_t k = 0; k < m; k++, j++) {
            PyObject *seg = sitems[k];
            uint64_t off, len, rid;
            PyObject *region = PyObject_GetAttr(seg, s_region);
            if (region == NULL) {
                Py_DECREF(segs);
                goto none;
            }
            PyObject *sid = PyLong_CheckExact(region) ? PyDict_GetItemWithError(ids, region) : NULL;
            Py_DECREF(region);
            if (sid == NULL || !PyLong_CheckExact(sid)) {
                Py_DECREF(segs);
                goto none;
            }
            rid = (uint64_t)PyLong_AsUnsignedLongLong(sid);
            if (PyErr_Occurred() || u64_attr(seg, s_offset, &off) < 0 || u64_attr(seg, s_length, &len) < 0) {
                Py_DECREF(segs);
                goto none;
            }
            memcpy(regions + 8 * j, &rid, 8);
            memcpy(offsets + 8 * j, &off, 8);
            memcpy(lengths + 8 * j, &len, 8);
        }
        Py_DECREF(segs);
    }
    if (j != nseg) goto none;
    if (multi && counts_bytes > 4 * nblocks) memset(counts + 4 * nblocks, 0, counts_bytes - 4 * nblocks);
    result = Py_BuildValue("(nnnO)", total, nblocks, nseg, multi ? Py_True : Py_False);
    PyBuffer_Release(&arena);
    return result;
none:
    PyErr_Clear();
    PyBuffer_Release(&arena);
    Py_RETURN_NONE;
}

/* ---- per-block work without the GIL: copies and checksums ------------------------------------- */

#define RELEASE_GIL_BYTES (16 << 10)

/* The buffers of a list/tuple of bytes-like objects (or one object), acquired; count in *n. */
static Py_buffer *get_buffers(PyObject *obj, int writable, Py_ssize_t *n, Py_ssize_t *total) {
    PyObject *seq = NULL;
    PyObject **items = &obj;
    Py_ssize_t count = 1;
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        seq = obj;
        count = PySequence_Fast_GET_SIZE(obj);
        items = PySequence_Fast_ITEMS(obj);
    }
    Py_buffer *views = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    *total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(items[i], &views[i], (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) {
            for (Py_ssize_t j = 0; j < i; j++) PyBuffer_Release(&views[j]);
            PyMem_Free(views);
            return NULL;
        }
        *total += views[i].len;
    }
    (void)seq;
    *n = count;
    return views;
}

static void release_buffers(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
}

/* Copy src segments into dst segments (equal totals), splitting where they differ. */
static void copy_segments(Py_buffer *dst, Py_ssize_t nd, Py_buffer *src, Py_ssize_t ns) {
    Py_ssize_t di = 0, si = 0, doff = 0, soff = 0;
    while (di < nd && si < ns) {
        Py_ssize_t n = dst[di].len - doff;
        if (src[si].len - soff < n) n = src[si].len - soff;
        if (n > 0) memcpy((char *)dst[di].buf + doff, (char *)src[si].buf + soff, (size_t)n);
        doff += n;
        soff += n;
        if (doff >= dst[di].len) {
            di++;
            doff = 0;
        }
        if (soff >= src[si].len) {
            si++;
            soff = 0;
        }
    }
}

PyDoc_STRVAR(copy_pairs_doc,
"copy_pairs(pairs) -> int\n\n"
"Copy each ``(dst, src)`` pair of a batch, each side a list of memoryviews (a block's segments) of\n"
"equal total length, with the GIL released for the copying: the bytes copied. A pair whose totals\n"
"differ is refused (ValueError) before anything is copied.");

static PyObject *copy_pairs(PyObject *self, PyObject *args) {
    PyObject *pairs;
    if (!PyArg_ParseTuple(args, "O", &pairs)) return NULL;
    PyObject *seq = PySequence_Fast(pairs, "pairs must be a sequence of (dst, src)");
    if (seq == NULL) return NULL;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer **dsts = PyMem_Calloc(np > 0 ? (size_t)np : 1, sizeof(Py_buffer *));
    Py_buffer **srcs = PyMem_Calloc(np > 0 ? (size_t)np : 1, sizeof(Py_buffer *));
    Py_ssize_t *nds = PyMem_Calloc(np > 0 ? (size_t)np : 1, sizeof(Py_ssize_t));
    Py_ssize_t *nss = PyMem_Calloc(np > 0 ? (size_t)np : 1, sizeof(Py_ssize_t));
    PyObject *result = NULL;
    Py_ssize_t got = 0, total = 0;
    if (!dsts || !srcs || !nds || !nss) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < np; got++) {
        PyObject *pair = items[got];
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError, "pair %zd is not a (dst, src) tuple", got);
            goto done;
        }
        Py_ssize_t dt, st;
        dsts[got] = get_buffers(PyTuple_GET_ITEM(pair, 0), 1, &nds[got], &dt);
        if (dsts[got] == NULL) goto done;
        srcs[got] = get_buffers(PyTuple_GET_ITEM(pair, 1), 0, &nss[got], &st);
        if (srcs[got] == NULL) {
            release_buffers(dsts[got], nds[got]);
            dsts[got] = NULL;
            goto done;
        }
        if (dt != st) {
            PyErr_Format(PyExc_ValueError, "pair %zd: %zd bytes of destination for %zd of source", got, dt, st);
            got++;
            goto done;
        }
        total += dt;
    }
    if (total >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < np; i++) copy_segments(dsts[i], nds[i], srcs[i], nss[i]);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < np; i++) copy_segments(dsts[i], nds[i], srcs[i], nss[i]);
    }
    result = PyLong_FromSsize_t(total);
done:
    for (Py_ssize_t i = 0; i < got && dsts && srcs; i++) {
        if (dsts[i]) release_buffers(dsts[i], nds[i]);
        if (srcs[i]) release_buffers(srcs[i], nss[i]);
    }
    PyMem_Free(dsts);
    PyMem_Free(srcs);
    PyMem_Free(nds);
    PyMem_Free(nss);
    Py_DECREF(seq);
    return result;
}

#ifdef UCM_HAVE_XXHASH
#define XXH_INLINE_ALL
#include <xxhash.h>

PyDoc_STRVAR(xxh3_64_doc,
"xxh3_64(data) -> int\n\n"
"XXH3-64 (seed 0) of a bytes-like object, or of the concatenation of a list of them (a block's\n"
"segments, never copied), as ``xxhash.xxh3_64_intdigest`` gives it, with the GIL released while it\n"
"hashes (a per-record checksum then runs on one core while another thread reads).");

static PyObject *xxh3_64(PyObject *self, PyObject *args) {
    PyObject *data;
    if (!PyArg_ParseTuple(args, "O", &data)) return NULL;
    Py_ssize_t n, total;
    Py_buffer *views = get_buffers(data, 0, &n, &total);
    if (views == NULL) return NULL;
    XXH64_hash_t h;
    if (n == 1) {
        if (total >= RELEASE_GIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            h = XXH3_64bits(views[0].buf, (size_t)views[0].len);
            Py_END_ALLOW_THREADS
        } else {
            h = XXH3_64bits(views[0].buf, (size_t)views[0].len);
        }
    } else {
        XXH3_state_t state;
        XXH3_INITSTATE(&state);
        XXH3_64bits_reset(&state);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) XXH3_64bits_update(&state, views[i].buf, (size_t)views[i].len);
        h = XXH3_64bits_digest(&state);
        Py_END_ALLOW_THREADS
    }
    release_buffers(views, n);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}
#endif

static PyObject *layout(PyObject *self, PyObject *unused) {
    static const struct {
        const char *name;
        long value;
    } constants[] = {
        {"T_VERSION", T_VERSION}, {"T_SEED", T_SEED}, {"T_NSLOTS", T_NSLOTS}, {"T_SLOTS_AT", T_SLOTS_AT},
        {"T_NS_CAPACITY", T_NS_CAPACITY}, {"T_NS_COUNT", T_NS_COUNT}, {"T_STATE", T_STATE},
        {"T_FLAGS", T_FLAGS}, {"T_VALID_UNTIL", T_VALID_UNTIL}, {"T_LIVE", T_LIVE}, {"T_USED", T_USED},
        {"T_DIR_AT", T_DIR_AT}, {"T_MAX_KEYS", T_MAX_KEYS}, {"SLOT_BYTES", SLOT_BYTES},
        {"DIR_ENTRY_BYTES", DIR_ENTRY_BYTES}, {"MAX_PROBE", MAX_PROBE}, {"TAG_DELETED", (long)TAG_DELETED},
        {"FLAG_COMPLETE", FLAG_COMPLETE}, {"DIR_TRACKED", DIR_TRACKED}, {"DIR_POPULATING", DIR_POPULATING},
        {"TABLE_LIVE", TABLE_LIVE}, {"NS_NONE", (long)NS_NONE},
    };
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++) {
        PyObject *v = PyLong_FromLong(constants[i].value);
        if (v == NULL || PyDict_SetItemString(d, constants[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyObject *monotonic(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(monotonic_ns());
}

static PyMethodDef methods[] = {
    {"table_lookup", table_lookup, METH_VARARGS, table_lookup_doc},
    {"table_find_ns", table_find_ns, METH_VARARGS, table_find_ns_doc},
    {"table_read_slot", table_read_slot, METH_VARARGS, table_read_slot_doc},
    {"table_apply", table_apply, METH_VARARGS, table_apply_doc},
    {"table_set", table_set, METH_VARARGS, table_set_doc},
    {"table_clear_bit", table_clear_bit, METH_VARARGS, table_clear_bit_doc},
    {"table_copy", table_copy, METH_VARARGS, table_copy_doc},
    {"load_u32", load_u32, METH_VARARGS, "load_u32(buf, offset): an acquire load of an aligned u32."},
    {"load_u64", load_u64, METH_VARARGS, "load_u64(buf, offset): an acquire load of an aligned u64."},
    {"store_u32", store_u32, METH_VARARGS, "store_u32(buf, offset, value): a release store of an aligned u32."},
    {"store_u64", store_u64, METH_VARARGS, "store_u64(buf, offset, value): a release store of an aligned u64."},
    {"add_u64", add_u64, METH_VARARGS, "add_u64(buf, offset, value): an atomic add to an aligned u64."},
    {"encode_batch", encode_batch, METH_VARARGS, encode_batch_doc},
    {"copy_pairs", copy_pairs, METH_VARARGS, copy_pairs_doc},
#ifdef UCM_HAVE_XXHASH
    {"xxh3_64", xxh3_64, METH_VARARGS, xxh3_64_doc},
#endif
    {"layout", layout, METH_NOARGS, "The layout constants this module was built with."},
    {"monotonic_ns", monotonic, METH_NOARGS, "CLOCK_MONOTONIC in nanoseconds (what T_VALID_UNTIL counts)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ucm_protocol._native",
    "The data plane's compiled loops: presence-table probes and updates, ring words, request bodies.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    s_key = PyUnicode_InternFromString("key");
    s_segments = PyUnicode_InternFromString("segments");
    s_region = PyUnicode_InternFromString("region");
    s_offset = PyUnicode_InternFromString("offset");
    s_length = PyUnicode_InternFromString("length");
    if (!s_key || !s_segments || !s_region || !s_offset || !s_length) return NULL;
    return PyModule_Create(&module);
}
