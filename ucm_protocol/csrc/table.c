/* The presence table: its readers (any process, any thread) and its one writer (the daemon's loop). */
#include "native.h"

/* The table's geometry from its header, checked against the buffer; -1 (ValueError set) if bad. */
static int table_open(Py_buffer *view, table_t *t) {
    char *b = (char *)view->buf;
    t->base = b;
    t->len = view->len;
    if (view->len < HEADER_MIN) goto bad;
    uint64_t nslots = rd64(b + T_NSLOTS), slots_at = rd64(b + T_SLOTS_AT), dir_at = rd64(b + T_DIR_AT);
    uint32_t cap = rd32(b + T_NS_CAPACITY);
    if (nslots == 0 || nslots > ((uint64_t)1 << 40)) goto bad;
    if (slots_at % 64 != 0 || dir_at % 8 != 0) goto bad;
    if (slots_at > (uint64_t)view->len || nslots > ((uint64_t)view->len - slots_at) / SLOT_BYTES) goto bad;
    if (dir_at > (uint64_t)view->len || (uint64_t)cap > ((uint64_t)view->len - dir_at) / DIR_ENTRY_BYTES) goto bad;
    t->slots = b + slots_at;
    t->nslots = nslots;
    t->seed = rd64(b + T_SEED);
    t->dir = b + dir_at;
    t->ns_capacity = cap;
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "not a presence table (its header does not fit the memory)");
    return -1;
}

static inline slot_t *slot_at(const table_t *t, uint64_t i) {
    return (slot_t *)(t->slots + i * SLOT_BYTES);
}

/* A key's first slot: its hash scaled to the slot count (any count, not only powers of two). */
static inline uint64_t first_slot(const table_t *t, uint64_t h) {
    return (uint64_t)(((unsigned __int128)h * t->nslots) >> 64);
}

static inline uint64_t next_slot(const table_t *t, uint64_t i) {
    return i + 1 == t->nslots ? 0 : i + 1;
}

/* ---- readers (any process, any thread) --------------------------------------------------------- */

/* A consistent copy of one slot (the sequence lock's read side); -1 if it kept changing. */
static int slot_read(slot_t *s, entry_t *copy) {
    for (int tries = 0; tries <= SEQ_RETRIES; tries++) {
        uint32_t s1 = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
        if (s1 & 1u) {
            cpu_relax();
            continue;
        }
        uint32_t tt = __atomic_load_n(&s->tt, __ATOMIC_RELAXED);
        for (int i = 0; i < 4; i++) copy->d[i] = __atomic_load_n(&s->d[i], __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&s->seq, __ATOMIC_RELAXED) == s1) {
            copy->tag = TAG_OF(tt);
            copy->tiers = TIERS_OF(tt);
            return 0;
        }
    }
    return -1;
}

/* 1 present, 0 absent, -1 cannot tell (probe bound reached, or a slot kept changing). ``h``: the
key's hash (computed ahead, so its first slot could be prefetched). */
static int probe_read(const table_t *t, uint32_t tag, const uint64_t d[4], uint64_t h) {
    uint64_t at = first_slot(t, h);
    for (uint64_t i = 0; i < MAX_PROBE && i < t->nslots; i++, at = next_slot(t, at)) {
        entry_t c;
        if (slot_read(slot_at(t, at), &c) < 0) return -1;
        if (c.tag == 0) return 0;
        if (c.tag == tag && c.d[0] == d[0] && c.d[1] == d[1] && c.d[2] == d[2] && c.d[3] == d[3]) return c.tiers != 0;
    }
    return -1;
}

const char ucm_table_read_slot_doc[] = (
"table_read_slot(table, index) -> (tag, tiers, digest) | None\n\n"
"What a reader sees in slot ``index``: one consistent copy, or None if it kept changing.");

PyObject *ucm_table_read_slot(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long long index;
    if (!PyArg_ParseTuple(args, "y*K", &view, &index)) return NULL;
    PyObject *result = NULL;
    table_t t;
    if (table_open(&view, &t) == 0) {
        if (index >= t.nslots) {
            PyErr_SetString(PyExc_IndexError, "slot index out of range");
        } else {
            entry_t c;
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

const char ucm_table_lookup_doc[] = (
"table_lookup(table, ns_id, keys, out) -> int\n\n"
"Presence of each 32-byte key of namespace ``ns_id``, one byte (0/1) per key into ``out``. Returns\n"
"the number of leading keys present (``ns_id`` NS_NONE: a namespace the directory of a table of every\n"
"namespace does not list: nothing of it is stored), or: -1 the table cannot answer (a key whose probe ran out, or\n"
"an incomplete table missing a key: ask the daemon), -2 a key is not 32 bytes of ``bytes`` (the\n"
"daemon names it), -3 the table is stale (superseded, closed, or its validity has passed).");

PyObject *ucm_table_lookup(PyObject *self, PyObject *args) {
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
    if (ns_id != NS_NONE && ns_id >= MAX_TAG) {
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
                __builtin_prefetch(slot_at(&t, first_slot(&t, ahead[i])), 0, 0);
            }
            for (Py_ssize_t i = 0; i < n; i++) {
                uint64_t h = ahead[i % PREFETCH_AHEAD];
                Py_ssize_t next = i + PREFETCH_AHEAD;
                if (next < n) {
                    ahead[next % PREFETCH_AHEAD] = slot_hash(t.seed, tag, digests + 4 * next);
                    __builtin_prefetch(slot_at(&t, first_slot(&t, ahead[next % PREFETCH_AHEAD])), 0, 0);
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

const char ucm_table_find_ns_doc[] = (
"table_find_ns(table, namespace) -> int\n\n"
"The directory id of a tracked ``namespace`` (16 bytes); -1 if it is not in the directory, -2 while\n"
"the daemon is still filling it in.");

PyObject *ucm_table_find_ns(PyObject *self, PyObject *args) {
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
    __atomic_store_n(&s->tt, TT(tag, tiers), __ATOMIC_RELAXED);
    for (int i = 0; i < 4; i++) __atomic_store_n(&s->d[i], d[i], __ATOMIC_RELAXED);
    __atomic_store_n(&s->seq, q + 2, __ATOMIC_RELEASE);
}

static void count_add(table_t *t, int off, int64_t delta) {
    uint64_t *p = (uint64_t *)(t->base + off);
    __atomic_store_n(p, __atomic_load_n(p, __ATOMIC_RELAXED) + (uint64_t)delta, __ATOMIC_RELAXED);
}

/* The slot holding the key, or NULL; *free: the first deleted or empty slot on the way (NULL if none). */
static slot_t *probe_write(const table_t *t, uint32_t tag, const uint64_t d[4], slot_t **free) {
    uint64_t at = first_slot(t, slot_hash(t->seed, tag, d));
    *free = NULL;
    for (uint64_t i = 0; i < MAX_PROBE && i < t->nslots; i++, at = next_slot(t, at)) {
        slot_t *s = slot_at(t, at);
        uint32_t got = TAG_OF(s->tt);
        if (got == 0) {
            if (*free == NULL) *free = s;
            return NULL;
        }
        if (got == TAG_DELETED) {
            if (*free == NULL) *free = s;
            continue;
        }
        if (got == tag && memcmp(s->d, d, 32) == 0) return s;
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
            uint32_t tiers = TIERS_OF(s->tt);
            if (tiers & bit) return 0;
            slot_store(s, tag, tiers | bit, d);
            return 1;
        }
        if (free == NULL) return -1;
        if (free->tt == 0) count_add(t, T_USED, 1);
        slot_store(free, tag, bit, d);
        count_add(t, T_LIVE, 1);
        return 1;
    }
    if (s == NULL || !(TIERS_OF(s->tt) & bit)) return 0;
    uint32_t left = TIERS_OF(s->tt) & ~bit;
    if (left) {
        slot_store(s, tag, left, d);
    } else {
        static const uint64_t zero[4] = {0, 0, 0, 0};
        slot_store(s, TAG_DELETED, 0, zero);
        count_add(t, T_LIVE, -1);
    }
    return 1;
}

static int check_bit(unsigned int bit) {
    if (bit == 0 || (bit & (bit - 1)) != 0 || bit >= (1u << MAX_TIERS)) {
        PyErr_SetString(PyExc_ValueError, "bit must be a single bit below 1 << 16");
        return -1;
    }
    return 0;
}

const char ucm_table_apply_doc[] = (
"table_apply(table, keys, ns_ids, bit, on) -> (done, unknown_namespaces, crowded)\n\n"
"Set (``on``) or clear tier ``bit`` for each 48-byte key (namespace + digest) whose namespace is in\n"
"``ns_ids`` (namespace -> directory id); keys of other namespaces are skipped and their namespaces\n"
"returned. ``done`` < len(keys): the key at that index found no slot within reach (rebuild the\n"
"table, then apply the rest); ``crowded``: rebuild it soon.");

const char ucm_table_set_doc[] = (
"table_set(table, key, ns_ids, bit, on) -> int\n\n"
"``table_apply`` for one key, without building a list or a tuple (an index change costs this call):\n"
"0 nothing changed, 1 changed, 2 changed and the table is crowded, -1 no slot within reach, -2 the\n"
"key's namespace is not in ``ns_ids``.");

PyObject *ucm_table_set(PyObject *self, PyObject *args) {
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
    if (check_bit(bit) < 0) goto done;
    if (klen != 48) {
        PyErr_SetString(PyExc_ValueError, "a 48-byte key expected");
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
    if (v < 0 || v >= (long)MAX_TAG) {
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

PyObject *ucm_table_apply(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *keys, *ns_ids;
    unsigned int bit;
    int on;
    if (!PyArg_ParseTuple(args, "w*OO!Ip", &view, &keys, &PyDict_Type, &ns_ids, &bit, &on)) return NULL;
    PyObject *result = NULL, *unknown = NULL, *seq = NULL;
    table_t t;
    if (table_open(&view, &t) < 0 || check_bit(bit) < 0) goto done;
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
                if (v < 0 || v >= (long)MAX_TAG) {
                    Py_DECREF(ns);
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "directory id out of range");
                    goto done;
                }
                last_id = v;
            }
            Py_DECREF(ns);
        }
        if (last_id < 0) continue;
        if (i + PREFETCH_AHEAD < n && PyBytes_Check(items[i + PREFETCH_AHEAD]) &&
            PyBytes_GET_SIZE(items[i + PREFETCH_AHEAD]) == 48) {
            /* the first slot of a key further on (if it is of this namespace, as keys mostly come) */
            uint64_t ahead[4];
            memcpy(ahead, PyBytes_AS_STRING(items[i + PREFETCH_AHEAD]) + 16, 32);
            __builtin_prefetch(slot_at(&t, first_slot(&t, slot_hash(t.seed, (uint32_t)last_id + 1, ahead))), 1, 0);
        }
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

const char ucm_table_clear_bit_doc[] = (
"table_clear_bit(table, bit) -> int\n\nClear tier ``bit`` in every slot (a tier that lost everything); the slots changed.");

PyObject *ucm_table_clear_bit(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned int bit;
    if (!PyArg_ParseTuple(args, "w*I", &view, &bit)) return NULL;
    table_t t;
    if (table_open(&view, &t) < 0 || check_bit(bit) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    long changed = 0;
    for (uint64_t i = 0; i < t.nslots; i++) {
        slot_t *s = slot_at(&t, i);
        uint32_t tag = TAG_OF(s->tt);
        if (tag == 0 || tag == TAG_DELETED || !(TIERS_OF(s->tt) & bit)) continue;
        uint64_t d[4];
        memcpy(d, s->d, 32);
        key_update(&t, tag, d, bit, 0);
        changed++;
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(changed);
}

const char ucm_table_copy_doc[] = (
"table_copy(src, dst) -> int\n\nInsert every entry of ``src`` into the empty table ``dst`` (a rebuild);\n"
"the entries copied, or -1 if ``dst`` had no slot within reach for one (make it larger).");

PyObject *ucm_table_copy(PyObject *self, PyObject *args) {
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
        uint32_t tag = TAG_OF(s->tt), tiers = TIERS_OF(s->tt);
        if (tag == 0 || tag == TAG_DELETED || tiers == 0) continue;
        slot_t *free;
        if (probe_write(&b, tag, s->d, &free) != NULL) continue;
        if (free == NULL) {
            failed = 1;
            break;
        }
        if (free->tt == 0) count_add(&b, T_USED, 1);
        slot_store(free, tag, tiers, s->d);
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
