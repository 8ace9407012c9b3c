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
#include "native.h"

static PyObject *layout(PyObject *self, PyObject *unused) {
    static const struct {
        const char *name;
        long value;
    } constants[] = {
        {"T_VERSION", T_VERSION}, {"T_SEED", T_SEED}, {"T_NSLOTS", T_NSLOTS}, {"T_SLOTS_AT", T_SLOTS_AT},
        {"T_NS_CAPACITY", T_NS_CAPACITY}, {"T_NS_COUNT", T_NS_COUNT}, {"T_STATE", T_STATE},
        {"T_FLAGS", T_FLAGS}, {"T_VALID_UNTIL", T_VALID_UNTIL}, {"T_LIVE", T_LIVE}, {"T_USED", T_USED},
        {"T_DIR_AT", T_DIR_AT}, {"T_MAX_KEYS", T_MAX_KEYS}, {"SLOT_BYTES", SLOT_BYTES},
        {"DIR_ENTRY_BYTES", DIR_ENTRY_BYTES}, {"MAX_PROBE", MAX_PROBE}, {"TAG_DELETED", (long)TAG_DELETED}, {"MAX_TIERS", MAX_TIERS},
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
    {"table_lookup", ucm_table_lookup, METH_VARARGS, ucm_table_lookup_doc},
    {"table_find_ns", ucm_table_find_ns, METH_VARARGS, ucm_table_find_ns_doc},
    {"table_read_slot", ucm_table_read_slot, METH_VARARGS, ucm_table_read_slot_doc},
    {"table_apply", ucm_table_apply, METH_VARARGS, ucm_table_apply_doc},
    {"table_set", ucm_table_set, METH_VARARGS, ucm_table_set_doc},
    {"table_clear_bit", ucm_table_clear_bit, METH_VARARGS, ucm_table_clear_bit_doc},
    {"table_copy", ucm_table_copy, METH_VARARGS, ucm_table_copy_doc},
    {"load_u32", ucm_load_u32, METH_VARARGS, "load_u32(buf, offset): an acquire load of an aligned u32."},
    {"load_u64", ucm_load_u64, METH_VARARGS, "load_u64(buf, offset): an acquire load of an aligned u64."},
    {"store_u32", ucm_store_u32, METH_VARARGS, "store_u32(buf, offset, value): a release store of an aligned u32."},
    {"store_u64", ucm_store_u64, METH_VARARGS, "store_u64(buf, offset, value): a release store of an aligned u64."},
    {"add_u64", ucm_add_u64, METH_VARARGS, "add_u64(buf, offset, value): an atomic add to an aligned u64."},
    {"encode_batch", ucm_encode_batch, METH_VARARGS, ucm_encode_batch_doc},
    {"copy_pairs", (PyCFunction)(void (*)(void))ucm_copy_pairs, METH_VARARGS | METH_KEYWORDS, ucm_copy_pairs_doc},
    {"copy_spans", (PyCFunction)(void (*)(void))ucm_copy_spans, METH_VARARGS | METH_KEYWORDS, ucm_copy_spans_doc},
#ifdef UCM_HAVE_XXHASH
    {"xxh3_64", ucm_xxh3_64, METH_VARARGS, ucm_xxh3_64_doc},
    {"xxh3_64_many", ucm_xxh3_64_many, METH_VARARGS, ucm_xxh3_64_many_doc},
    {"read_records", ucm_read_records, METH_VARARGS, ucm_read_records_doc},
#endif
    {"index_keys", ucm_index_keys, METH_VARARGS, ucm_index_keys_doc},
    {"index_fill", ucm_index_fill, METH_VARARGS, ucm_index_fill_doc},
    {"block_keys", ucm_block_keys, METH_VARARGS, ucm_block_keys_doc},
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
    if (ucm_ring_init() < 0) return NULL;
    return PyModule_Create(&module);
}
