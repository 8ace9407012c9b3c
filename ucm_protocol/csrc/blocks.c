/* Per-block work without the GIL: copies of many blocks in one call, XXH3 checksums. */
#include "native.h"

#include <pthread.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

/* One contiguous copy: a piece of a block, or several blocks that continue each other on both sides. */
typedef struct {
    char *dst;
    const char *src;
    size_t n;
} run_t;

typedef struct {
    run_t *runs;
    Py_ssize_t nruns;
    int stream;
} runs_t;

/* Append src segments -> dst segments (equal totals) as runs, split where the segments differ and
 * merged with the previous run where both sides continue it. */
static void add_runs(runs_t *r, Py_buffer *dst, Py_ssize_t nd, Py_buffer *src, Py_ssize_t ns) {
    Py_ssize_t di = 0, si = 0, doff = 0, soff = 0;
    while (di < nd && si < ns) {
        Py_ssize_t n = dst[di].len - doff;
        if (src[si].len - soff < n) n = src[si].len - soff;
        if (n > 0) {
            char *d = (char *)dst[di].buf + doff;
            const char *s = (const char *)src[si].buf + soff;
            run_t *last = r->nruns ? &r->runs[r->nruns - 1] : NULL;
            if (last != NULL && last->dst + last->n == d && last->src + last->n == s) {
                last->n += (size_t)n;
            } else {
                r->runs[r->nruns++] = (run_t){d, s, (size_t)n};
            }
        }
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

/* A run copied with non-temporal stores: the bytes go to memory without first reading the
 * destination's lines into the cache (a plain memcpy of a batch larger than the cache reads every
 * destination line before writing it, and evicts what the cache held for nothing). */
static void stream_run(char *d, const char *s, size_t n) {
#if defined(__SSE2__)
    if (d < s + n && s < d + n) { /* overlapping: never between a client's memory and the daemon's */
        memmove(d, s, n);
        return;
    }
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; d += 64, s += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
#else
    memmove(d, s, n);
#endif
}

/* Copy the runs; ``stream``: with non-temporal stores, ordered before this returns (a reader told
 * the copy is done then sees every byte). */
static void copy_runs(const run_t *runs, Py_ssize_t n, int stream) {
    if (!stream) {
        for (Py_ssize_t i = 0; i < n; i++) memmove(runs[i].dst, runs[i].src, runs[i].n);
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) stream_run(runs[i].dst, runs[i].src, runs[i].n);
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

static void *copy_runs_thread(void *arg) {
    runs_t *half = arg;
    copy_runs(half->runs, half->nruns, half->stream);
    return NULL;
}

/* Copy the runs (GIL released by the caller): from ``split`` bytes on, the second half of the bytes
 * in a thread of its own while this one copies the first (a run may be cut in two). */
static void copy_split(run_t *runs, Py_ssize_t nruns, size_t total, size_t split, int stream) {
    if (split == 0 || total < split || nruns == 0) {
        copy_runs(runs, nruns, stream);
        return;
    }
    size_t half = total / 2, taken = 0;
    Py_ssize_t cut = 0;
    while (cut < nruns && taken + runs[cut].n <= half) taken += runs[cut++].n;
    /* runs[0..cut) make ``taken`` bytes; run ``cut`` (if any) is cut at ``half - taken``. */
    run_t head = {0}, tail = {0};
    if (cut < nruns) {
        size_t k = half - taken;
        head = (run_t){runs[cut].dst, runs[cut].src, k};
        tail = (run_t){runs[cut].dst + k, runs[cut].src + k, runs[cut].n - k};
    }
    if (cut < nruns) runs[cut] = tail; /* the helper's first run; ``head`` is this thread's last */
    runs_t second = {&runs[cut], nruns - cut, stream};
    pthread_t helper;
    int started = pthread_create(&helper, NULL, copy_runs_thread, &second) == 0;
    copy_runs(runs, cut, stream);
    if (head.n) copy_runs(&head, 1, stream);
    if (started) {
        pthread_join(helper, NULL);
    } else {
        copy_runs(second.runs, second.nruns, stream);
    }
}

const char ucm_copy_pairs_doc[] = (
"copy_pairs(pairs, split_bytes=0, stream_bytes=0) -> int\n\n"
"Copy each ``(dst, src)`` pair of a batch, each side a list of memoryviews (a block's segments) of\n"
"equal total length, with the GIL released for the copying: the bytes copied. Pieces that continue\n"
"each other on both sides are copied as one run (a long copy runs faster than many short ones); a\n"
"batch of ``split_bytes`` or more (0: never) is copied by two threads, half of the bytes each, and one\n"
"of ``stream_bytes`` or more (0: never) with non-temporal stores (past the cache: for batches larger\n"
"than it). A pair whose totals differ is refused (ValueError) before anything is copied.");

PyObject *ucm_copy_pairs(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"pairs", "split_bytes", "stream_bytes", NULL};
    PyObject *pairs;
    Py_ssize_t split = 0, stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|nn", kwlist, &pairs, &split, &stream)) return NULL;
    if (split < 0 || stream < 0) {
        PyErr_Format(PyExc_ValueError, "split_bytes and stream_bytes must be 0 or more, not %zd and %zd", split,
                     stream);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(pairs, "pairs must be a sequence of (dst, src)");
    if (seq == NULL) return NULL;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer **dsts = PyMem_Calloc(np > 0 ? (size_t)np : 1, sizeof(Py_buffer *));
    Py_buffer **srcs = PyMem_Calloc(np > 0 ? (size_t)np : 1, sizeof(Py_buffer *));
    Py_ssize_t *nds = PyMem_Calloc(np > 0 ? (size_t)np : 1, sizeof(Py_ssize_t));
    Py_ssize_t *nss = PyMem_Calloc(np > 0 ? (size_t)np : 1, sizeof(Py_ssize_t));
    run_t *runs = NULL;
    PyObject *result = NULL;
    Py_ssize_t got = 0, total = 0, most_runs = 0;
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
        most_runs += nds[got] + nss[got]; /* a pair's pieces: at most one per segment boundary */
    }
    runs = PyMem_Malloc((size_t)(most_runs > 0 ? most_runs : 1) * sizeof(run_t));
    if (runs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int streamed = stream > 0 && total >= stream;
    runs_t r = {runs, 0, streamed};
    for (Py_ssize_t i = 0; i < np; i++) add_runs(&r, dsts[i], nds[i], srcs[i], nss[i]);
    if (total >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        copy_split(runs, r.nruns, (size_t)total, (size_t)split, streamed);
        Py_END_ALLOW_THREADS
    } else {
        copy_runs(runs, r.nruns, streamed);
    }
    result = PyLong_FromSsize_t(total);
done:
    for (Py_ssize_t i = 0; i < got && dsts && srcs; i++) {
        if (dsts[i]) release_buffers(dsts[i], nds[i]);
        if (srcs[i]) release_buffers(srcs[i], nss[i]);
    }
    PyMem_Free(runs);
    PyMem_Free(dsts);
    PyMem_Free(srcs);
    PyMem_Free(nds);
    PyMem_Free(nss);
    Py_DECREF(seq);
    return result;
}

/* The integers of a list or tuple as uint64 (a negative or too large one: -1 and the error set). */
static int u64_items(PyObject *seq, const char *what, Py_ssize_t n, uint64_t *out) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long v = PyLong_Check(items[i]) ? PyLong_AsUnsignedLongLong(items[i]) : (unsigned long long)-1;
        if (!PyLong_Check(items[i]) || (v == (unsigned long long)-1 && PyErr_Occurred())) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "span %zd: %s is not an integer in [0, 2**64)", i, what);
            return -1;
        }
        out[i] = (uint64_t)v;
    }
    return 0;
}

const char ucm_copy_spans_doc[] = (
"copy_spans(dst, dst_offsets, src, src_offsets, lengths, split_bytes=0, stream_bytes=0) -> int\n\n"
"Copy span i, ``lengths[i]`` bytes from ``src_offsets[i]`` of ``src`` to ``dst_offsets[i]`` of\n"
"``dst`` (two buffers: a client's region and the Cache's arena), for every i, with the GIL released\n"
"for the copying: the bytes copied. The offsets and lengths are lists of ints and nothing else is\n"
"made per span: a batch of small blocks costs no memoryview a block. Every span is checked first\n"
"(a length of 0, an offset or length that is not an int in [0, 2**64), a span past either buffer's\n"
"end, whatever the sum overflows to): one bad span refuses the batch (ValueError naming it) with\n"
"nothing copied. Spans that continue each other on both sides are copied as one run;\n"
"``split_bytes`` and ``stream_bytes`` are ``copy_pairs``'s.");

PyObject *ucm_copy_spans(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"dst", "dst_offsets", "src", "src_offsets", "lengths", "split_bytes", "stream_bytes", NULL};
    PyObject *dsto, *srco, *doffs, *soffs, *lens;
    Py_ssize_t split = 0, stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|nn", kwlist, &dsto, &doffs, &srco, &soffs, &lens, &split,
                                     &stream))
        return NULL;
    if (split < 0 || stream < 0) {
        PyErr_Format(PyExc_ValueError, "split_bytes and stream_bytes must be 0 or more, not %zd and %zd", split,
                     stream);
        return NULL;
    }
    if (!(PyList_Check(doffs) || PyTuple_Check(doffs)) || !(PyList_Check(soffs) || PyTuple_Check(soffs)) ||
        !(PyList_Check(lens) || PyTuple_Check(lens))) {
        PyErr_SetString(PyExc_TypeError, "dst_offsets, src_offsets and lengths must be lists or tuples of ints");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(lens);
    if (PySequence_Fast_GET_SIZE(doffs) != n || PySequence_Fast_GET_SIZE(soffs) != n) {
        PyErr_Format(PyExc_ValueError, "%zd destination offsets and %zd source offsets for %zd lengths",
                     PySequence_Fast_GET_SIZE(doffs), PySequence_Fast_GET_SIZE(soffs), n);
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dsto, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(srco, &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    uint64_t *words = PyMem_Malloc((size_t)(n > 0 ? n : 1) * 3 * sizeof(uint64_t));
    run_t *runs = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(run_t));
    if (words == NULL || runs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *dof = words, *sof = words + n, *len = words + 2 * n;
    if (u64_items(doffs, "the destination offset", n, dof) < 0 || u64_items(soffs, "the source offset", n, sof) < 0 ||
        u64_items(lens, "the length", n, len) < 0)
        goto done;
    uint64_t dlen = (uint64_t)dst.len, slen = (uint64_t)src.len, total = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* every span checked before any byte moves */
        if (len[i] == 0) {
            PyErr_Format(PyExc_ValueError, "span %zd has length 0", i);
            goto done;
        }
        /* no sum that could wrap: the length fits the buffer, then the offset fits what is left */
        if (len[i] > dlen || dof[i] > dlen - len[i]) {
            PyErr_Format(PyExc_ValueError, "span %zd: %llu bytes at offset %llu are outside the %llu-byte destination", i,
                         (unsigned long long)len[i], (unsigned long long)dof[i], (unsigned long long)dlen);
            goto done;
        }
        if (len[i] > slen || sof[i] > slen - len[i]) {
            PyErr_Format(PyExc_ValueError, "span %zd: %llu bytes at offset %llu are outside the %llu-byte source", i,
                         (unsigned long long)len[i], (unsigned long long)sof[i], (unsigned long long)slen);
            goto done;
        }
        total += len[i]; /* at most n times a buffer's size: no wrap for any n memory can hold */
    }
    Py_ssize_t nruns = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        char *d = (char *)dst.buf + dof[i];
        const char *s = (const char *)src.buf + sof[i];
        run_t *last = nruns ? &runs[nruns - 1] : NULL;
        if (last != NULL && last->dst + last->n == d && last->src + last->n == s) {
            last->n += (size_t)len[i];
        } else {
            runs[nruns++] = (run_t){d, s, (size_t)len[i]};
        }
    }
    int streamed = stream > 0 && total >= (uint64_t)stream;
    if (total >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        copy_split(runs, nruns, (size_t)total, (size_t)split, streamed);
        Py_END_ALLOW_THREADS
    } else {
        copy_runs(runs, nruns, streamed);
    }
    result = PyLong_FromUnsignedLongLong((unsigned long long)total);
done:
    PyMem_Free(words);
    PyMem_Free(runs);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

#ifdef UCM_HAVE_XXHASH
#define XXH_INLINE_ALL
#include "vendor/xxhash.h" /* xxHash 0.8.4, BSD 2-Clause: vendor/LICENSE-xxhash */

const char ucm_xxh3_64_doc[] = (
"xxh3_64(data) -> int\n\n"
"XXH3-64 (seed 0) of a bytes-like object, or of the concatenation of a list of them (a block's\n"
"segments, never copied), as ``xxhash.xxh3_64_intdigest`` gives it, with the GIL released while it\n"
"hashes 16 KiB or more.");

PyObject *ucm_xxh3_64(PyObject *self, PyObject *args) {
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

const char ucm_xxh3_64_many_doc[] = (
"xxh3_64_many(blocks) -> list[int]\n\n"
"``xxh3_64`` of each block of a batch (each a bytes-like object or a list of them), the GIL released\n"
"once for the whole batch: per-record checksums of small blocks in one call, so a reader thread is\n"
"not stopped block by block (xxhash itself releases the GIL only for large inputs, and a release\n"
"per small block costs more than it gives when another thread holds on to the GIL).");

PyObject *ucm_xxh3_64_many(PyObject *self, PyObject *args) {
    PyObject *blocks;
    if (!PyArg_ParseTuple(args, "O", &blocks)) return NULL;
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer **views = PyMem_Calloc(nb > 0 ? (size_t)nb : 1, sizeof(Py_buffer *));
    Py_ssize_t *counts = PyMem_Calloc(nb > 0 ? (size_t)nb : 1, sizeof(Py_ssize_t));
    XXH64_hash_t *out = PyMem_Calloc(nb > 0 ? (size_t)nb : 1, sizeof(XXH64_hash_t));
    PyObject *result = NULL;
    Py_ssize_t got = 0;
    if (!views || !counts || !out) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < nb; got++) {
        Py_ssize_t total;
        views[got] = get_buffers(items[got], 0, &counts[got], &total);
        if (views[got] == NULL) goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < nb; i++) {
        if (counts[i] == 1) {
            out[i] = XXH3_64bits(views[i][0].buf, (size_t)views[i][0].len);
        } else {
            XXH3_state_t state;
            XXH3_INITSTATE(&state);
            XXH3_64bits_reset(&state);
            for (Py_ssize_t j = 0; j < counts[i]; j++) XXH3_64bits_update(&state, views[i][j].buf, (size_t)views[i][j].len);
            out[i] = XXH3_64bits_digest(&state);
        }
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(nb);
    for (Py_ssize_t i = 0; result != NULL && i < nb; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)out[i]);
        if (v == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, v);
    }
done:
    for (Py_ssize_t i = 0; i < got && views; i++) release_buffers(views[i], counts[i]);
    PyMem_Free(views);
    PyMem_Free(counts);
    PyMem_Free(out);
    Py_DECREF(seq);
    return result;
}
#endif
