/*
 * Building a million-entry index from a snapshot's key column: the keys as ``bytes`` with their
 * hashes computed while each is still in cache (a later pass misses it on every key), and the
 * entries put in a dict straight from two lists (``dict.update(zip(...))`` makes and unpacks a
 * tuple per entry). Each call holds the interpreter; the caller works in slices so that the event
 * loop gets it between them.
 */
#include "native.h"

const char ucm_index_keys_doc[] =
    "index_keys(records, width) -> list[bytes]: each ``width``-byte record of ``records`` as bytes,\n"
    "its hash already computed (a dict insert then does not read it again).";

PyObject *ucm_index_keys(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "y*n", &buf, &width))
        return NULL;
    PyObject *out = NULL;
    if (width <= 0 || buf.len % width) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole records of %zd bytes", buf.len, width);
        goto done;
    }
    Py_ssize_t n = buf.len / width;
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    const char *at = (const char *)buf.buf;
    for (Py_ssize_t i = 0; i < n; i++, at += width) {
        PyObject *key = PyBytes_FromStringAndSize(at, width);
        if (key == NULL || PyObject_Hash(key) == -1) {
            Py_XDECREF(key);
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, key);
    }
done:
    PyBuffer_Release(&buf);
    return out;
}

const char ucm_index_fill_doc[] =
    "index_fill(into, keys, values, start, stop): ``into[keys[i]] = values[i]`` for ``start <= i <\n"
    "stop`` (two lists of one length), in order: a key given twice keeps its first place and its last value.";

PyObject *ucm_index_fill(PyObject *self, PyObject *args) {
    PyObject *into, *keys, *values;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "O!O!O!nn", &PyDict_Type, &into, &PyList_Type, &keys, &PyList_Type, &values,
                          &start, &stop))
        return NULL;
    if (PyList_GET_SIZE(keys) != PyList_GET_SIZE(values)) {
        PyErr_Format(PyExc_ValueError, "%zd keys and %zd values", PyList_GET_SIZE(keys), PyList_GET_SIZE(values));
        return NULL;
    }
    if (start < 0 || stop < start || stop > PyList_GET_SIZE(keys)) {
        PyErr_Format(PyExc_IndexError, "slice %zd:%zd of %zd entries", start, stop, PyList_GET_SIZE(keys));
        return NULL;
    }
    for (Py_ssize_t i = start; i < stop; i++) {
        /* a key's __hash__ or __eq__ may run Python code that shrinks a list: look again each time */
        if (i >= PyList_GET_SIZE(keys) || i >= PyList_GET_SIZE(values)) {
            PyErr_SetString(PyExc_RuntimeError, "index_fill: a list changed size during the fill");
            return NULL;
        }
        if (PyDict_SetItem(into, PyList_GET_ITEM(keys, i), PyList_GET_ITEM(values, i)) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

const char ucm_block_keys_doc[] =
    "block_keys(cls, namespace, packed) -> list[cls]: ``namespace + digest`` as an instance of ``cls``\n"
    "(a ``bytes`` subclass with no instance dict: ``BlockKey``) for each 32-byte digest of ``packed``,\n"
    "one object made a key (the Python way made the digest, the sum and the key).";

PyObject *ucm_block_keys(PyObject *self, PyObject *args) {
    PyTypeObject *cls;
    Py_buffer ns, packed;
    if (!PyArg_ParseTuple(args, "O!y*y*", &PyType_Type, &cls, &ns, &packed))
        return NULL;
    PyObject *out = NULL;
#if PY_VERSION_HEX >= 0x030E0000
    PyErr_SetString(PyExc_NotImplementedError, "block_keys: this Python's bytes layout is not known here");
    goto done;
#else
    if (!PyType_IsSubtype(cls, &PyBytes_Type) || cls->tp_basicsize != PyBytes_Type.tp_basicsize ||
        cls->tp_itemsize != PyBytes_Type.tp_itemsize || cls->tp_dictoffset != 0) {
        PyErr_SetString(PyExc_TypeError, "block_keys: cls must be a bytes subclass with no instance dict or slots");
        goto done;
    }
    if (ns.len != 16 || packed.len % 32) {
        PyErr_Format(PyExc_ValueError, "block_keys: a 16-byte namespace and whole 32-byte digests, not %zd and %zd bytes",
                     ns.len, packed.len);
        goto done;
    }
    Py_ssize_t n = packed.len / 32;
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    const char *digest = (const char *)packed.buf;
    for (Py_ssize_t i = 0; i < n; i++, digest += 32) {
        /* as CPython's own bytes.__new__ for a subclass: tp_alloc, the bytes, the hash unknown */
        PyObject *key = cls->tp_alloc(cls, 48);
        if (key == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        char *at = PyBytes_AS_STRING(key);
        memcpy(at, ns.buf, 16);
        memcpy(at + 16, digest, 32);
        at[48] = '\0';
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
        ((PyBytesObject *)key)->ob_shash = -1;
#pragma GCC diagnostic pop
        PyList_SET_ITEM(out, i, key);
    }
#endif
done:
    PyBuffer_Release(&ns);
    PyBuffer_Release(&packed);
    return out;
}
