/* The ring: ordered loads and stores of its words, and the client's writing of a request body. */
#include "native.h"

/* ---- ordered loads and stores of ring indices and header words --------------------------------- */

static int word_at(Py_buffer *view, Py_ssize_t off, Py_ssize_t size) {
    if (off < 0 || off % size != 0 || off > view->len - size || ((uintptr_t)view->buf % size) != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not an aligned word of a %zd-byte buffer", off, view->len);
        return -1;
    }
    return 0;
}

enum word_op { LOAD, STORE, ADD };

/* One ordered access to an aligned word of ``size`` bytes of a buffer: the arguments are the buffer,
the offset and (but for a load) the value. */
static PyObject *word(PyObject *args, Py_ssize_t size, enum word_op op) {
    Py_buffer v;
    Py_ssize_t off;
    unsigned long long value = 0;
    int parsed = op == LOAD ? PyArg_ParseTuple(args, "y*n", &v, &off) : PyArg_ParseTuple(args, "w*nK", &v, &off, &value);
    if (!parsed) return NULL;
    PyObject *r = NULL;
    if (word_at(&v, off, size) == 0) {
        char *at = (char *)v.buf + off;
        if (op == LOAD)
            r = PyLong_FromUnsignedLongLong(size == 4 ? __atomic_load_n((uint32_t *)at, __ATOMIC_ACQUIRE)
                                                      : __atomic_load_n((uint64_t *)at, __ATOMIC_ACQUIRE));
        else if (op == STORE && size == 4)
            __atomic_store_n((uint32_t *)at, (uint32_t)value, __ATOMIC_RELEASE);
        else if (op == STORE)
            __atomic_store_n((uint64_t *)at, (uint64_t)value, __ATOMIC_RELEASE);
        else
            __atomic_fetch_add((uint64_t *)at, (uint64_t)value, __ATOMIC_RELEASE);
        if (op != LOAD) r = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&v);
    return r;
}

PyObject *ucm_load_u32(PyObject *self, PyObject *args) { return word(args, 4, LOAD); }
PyObject *ucm_load_u64(PyObject *self, PyObject *args) { return word(args, 8, LOAD); }
PyObject *ucm_store_u32(PyObject *self, PyObject *args) { return word(args, 4, STORE); }
PyObject *ucm_store_u64(PyObject *self, PyObject *args) { return word(args, 8, STORE); }
PyObject *ucm_add_u64(PyObject *self, PyObject *args) { return word(args, 8, ADD); }

/* ---- a Load/Dump body, written by the client into its ring's arena ------------------------------ */

static PyObject *s_key, *s_segments, *s_region, *s_offset, *s_length;

int ucm_ring_init(void) {
    s_key = PyUnicode_InternFromString("key");
    s_segments = PyUnicode_InternFromString("segments");
    s_region = PyUnicode_InternFromString("region");
    s_offset = PyUnicode_InternFromString("offset");
    s_length = PyUnicode_InternFromString("length");
    return (s_key && s_segments && s_region && s_offset && s_length) ? 0 : -1;
}

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

const char ucm_encode_batch_doc[] = (
"encode_batch(arena, offset, limit, namespace, blocks, server_ids) -> (nbytes, nblocks, nsegments, multi) | None\n\n"
"Write a Load/Dump body (ucm_protocol.dataplane.body_bytes) for ``blocks`` (BlockIO objects) at\n"
"``offset`` of ``arena``, ending before ``limit``; ``server_ids``: region handle -> the daemon's id.\n"
"None when anything is not exactly as expected (a key not 32 bytes of bytes, a handle not in\n"
"``server_ids``, a field that is not an int in [0, 2**64), no room): the caller then builds the\n"
"request the checked way, whose errors name the culprit.");

PyObject *ucm_encode_batch(PyObject *self, PyObject *args) {
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
