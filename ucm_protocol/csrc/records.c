/*
 * Packed records read and checked without the GIL: the Posix tier's loads of small packed blocks.
 *
 * A pack holds many blocks, each as its 128-byte header (ucm_server/store/format.py) then its
 * payload. A load of 4 KiB blocks reads ~256 records a job; in Python every record costs list
 * building, a CRC, a checksum and a dozen array checks while holding the GIL, and on two cores the
 * event loop then waits for the GIL behind the reader threads. Here one call reads a pack's records
 * (one preadv per run of nearby records) and checks each header and payload with the GIL released.
 *
 * Nothing read from the file is trusted: a record outside the file, a header that does not name the
 * block asked for, its length, a readable version or its own CRC, or a payload that does not match
 * its checksum fails that block alone (its destination zeroed, except a payload mismatch, which the
 * caller may want to read again through its own memory).
 */
#include "native.h"

#ifdef UCM_HAVE_XXHASH
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/uio.h>
#define XXH_INLINE_ALL
#include "vendor/xxhash.h" /* xxHash 0.8.4, BSD 2-Clause: vendor/LICENSE-xxhash */

/* A record's header: mirrors ucm_server/store/format.py (_FIELDS, _FIELDS_AND_CRC); a test
 * compares the outcomes with the Python checks on every kind of damage. */
#define REC_HEADER 128
#define REC_MAGIC 0x424D4355u /* "UCMB" little endian */
#define REC_VERSION_AT 4
#define REC_HEADER_LEN_AT 8
#define REC_KEY_AT 12
#define REC_KEY_BYTES 48
#define REC_PAYLOAD_LEN_AT 60
#define REC_CHECKSUM_AT 68
#define REC_PADDING_AT 88

/* Outcomes, one byte a record (ucm_server/store/posix/packs.py names them). */
#define OUT_OK 0
#define OUT_MISMATCH 1
#define OUT_BAD_HEADER 2
#define OUT_TOMBSTONE 3
#define OUT_OUTSIDE 4
#define OUT_READ_ERROR 5
#define OUT_SHORT 6
#define OUT_PENDING 255

/* A run of records side by side ends once it holds this many bytes, so each record is checked
 * while its bytes are still in the CPU's caches rather than after a whole pack has been read. */
#define RUN_BYTES (1u << 20)

static uint32_t crc_table[256];

static void crc_init(void) {
    if (crc_table[1]) return;
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

/* zlib's crc32 (seed 0). */
static uint32_t crc32_of(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static int all_zero(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

/* preadv until every byte of ``iov`` is read: 0, an errno, or -1 where the file ends first.
 * ``iov`` is consumed (bases and lengths advanced). */
static int preadv_full(int fd, struct iovec *iov, Py_ssize_t count, uint64_t offset) {
    while (count > 0) {
        int take = count > IOV_MAX ? IOV_MAX : (int)count;
        ssize_t n = preadv(fd, iov, take, (off_t)offset);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (n == 0) return -1;
        offset += (uint64_t)n;
        while (count > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0 && n > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return 0;
}

typedef struct {
    uint64_t offset;
    Py_ssize_t index;
} place_t;

static int by_offset(const void *a, const void *b) {
    const place_t *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

typedef struct {
    int fd;
    uint64_t size, first, max_payload, readable, gap_max;
    uint32_t whole_crc;
    Py_ssize_t n;
    const uint64_t *offsets;
    const unsigned char *keys;
    Py_buffer *dests;
    unsigned char *heads, *codes, *scratch;
    place_t *order;
    struct iovec *iov;
    Py_ssize_t *run;
    int error;
} job_t;

static unsigned char check_record(const job_t *j, Py_ssize_t i);

/* The records of one run (``members``, in file order) read by one preadv from ``at``, then each
 * checked while its bytes are still in the CPU's caches; a failed read fails them all, their
 * destinations zeroed. */
static void flush_run(job_t *j, Py_ssize_t members, Py_ssize_t niov, uint64_t at) {
    if (members == 0) return;
    int r = preadv_full(j->fd, j->iov, niov, at);
    if (r > 0 && j->error == 0) j->error = r;
    for (Py_ssize_t m = 0; m < members; m++) {
        Py_ssize_t i = j->run[m];
        if (r == 0) {
            j->codes[i] = check_record(j, i);
        } else {
            j->codes[i] = r < 0 ? OUT_SHORT : OUT_READ_ERROR;
            memset(j->dests[i].buf, 0, (size_t)j->dests[i].len);
        }
    }
}

static unsigned char check_record(const job_t *j, Py_ssize_t i) {
    const unsigned char *h = j->heads + (size_t)i * REC_HEADER;
    uint64_t want = (uint64_t)j->dests[i].len;
    uint32_t version = (uint32_t)h[REC_VERSION_AT] | ((uint32_t)h[REC_VERSION_AT + 1] << 8);
    int valid = rd32((const char *)h) == REC_MAGIC && version < 64 && ((j->readable >> version) & 1) &&
                rd32((const char *)h + REC_HEADER_LEN_AT) == REC_HEADER &&
                rd64((const char *)h + REC_PAYLOAD_LEN_AT) == want && want <= j->max_payload &&
                memcmp(h + REC_KEY_AT, j->keys + (size_t)i * REC_KEY_BYTES, REC_KEY_BYTES) == 0 &&
                crc32_of(h, REC_HEADER) == j->whole_crc && all_zero(h + REC_PADDING_AT, REC_HEADER - REC_PADDING_AT);
    if (!valid) {
        memset(j->dests[i].buf, 0, (size_t)want);
        return all_zero(h, REC_HEADER) ? OUT_TOMBSTONE : OUT_BAD_HEADER;
    }
    if (XXH3_64bits(j->dests[i].buf, (size_t)want) != rd64((const char *)h + REC_CHECKSUM_AT)) return OUT_MISMATCH;
    return OUT_OK;
}

/* Everything without the GIL: order, runs, reads, checks. */
static void run_job(job_t *j) {
    for (Py_ssize_t i = 0; i < j->n; i++) j->order[i] = (place_t){j->offsets[i], i};
    qsort(j->order, (size_t)j->n, sizeof(place_t), by_offset);
    Py_ssize_t members = 0, niov = 0;
    uint64_t at = 0, pos = 0;
    for (Py_ssize_t k = 0; k < j->n; k++) {
        Py_ssize_t i = j->order[k].index;
        uint64_t offset = j->offsets[i], len = (uint64_t)j->dests[i].len;
        if (offset < j->first || offset > j->size || j->size - offset < REC_HEADER ||
            j->size - offset - REC_HEADER < len) {
            j->codes[i] = OUT_OUTSIDE;
            memset(j->dests[i].buf, 0, (size_t)len);
            continue;
        }
        if (members && (offset < pos || offset - pos > j->gap_max || pos - at >= RUN_BYTES)) {
            flush_run(j, members, niov, at);
            members = niov = 0;
        }
        if (!members) {
            at = offset;
        } else if (offset > pos) {
            j->iov[niov++] = (struct iovec){j->scratch, (size_t)(offset - pos)};
        }
        j->iov[niov++] = (struct iovec){j->heads + (size_t)i * REC_HEADER, REC_HEADER};
        if (len) j->iov[niov++] = (struct iovec){j->dests[i].buf, (size_t)len};
        j->run[members++] = i;
        pos = offset + REC_HEADER + len;
    }
    flush_run(j, members, niov, at);
}

const char ucm_read_records_doc[] = (
"read_records(fd, size, first, offsets, keys, dests, max_payload, whole_crc, readable, gap_max)\n"
"    -> (outcomes: bytes, errno: int)\n\n"
"Read the records at ``offsets`` of the open pack ``fd`` (``size`` bytes, records from ``first``) into\n"
"``dests`` (a writable buffer a record, or a list of one, its payload's length) and check each: its 128-byte header\n"
"names ``keys[48*i:48*i+48]`` and the destination's length (at most ``max_payload``), has a version\n"
"in the bit mask ``readable``, zero padding and a CRC-32 over the whole header of ``whole_crc``; its\n"
"payload's XXH3-64 is the header's checksum. Records less than ``gap_max`` bytes apart are read by\n"
"one preadv (the gap into scratch). One outcome byte a record: 0 verified, 1 payload mismatch, 2 bad\n"
"header, 3 tombstone (an all-zero header), 4 outside the file, 5 read error (``errno``), 6 the file\n"
"ended first; every failure but 1 zeroes its destination. The GIL is released for all of it.");

PyObject *ucm_read_records(PyObject *self, PyObject *args) {
    int fd;
    unsigned long long size, first, max_payload, readable, gap_max;
    unsigned int whole_crc;
    PyObject *offsets_obj, *dests_obj;
    Py_buffer keys;
    if (!PyArg_ParseTuple(args, "iKKOy*OKIKK", &fd, &size, &first, &offsets_obj, &keys, &dests_obj, &max_payload,
                          &whole_crc, &readable, &gap_max))
        return NULL;
    PyObject *result = NULL;
    PyObject *offsets_seq = PySequence_Fast(offsets_obj, "offsets must be a sequence");
    PyObject *dests_seq = offsets_seq ? PySequence_Fast(dests_obj, "dests must be a sequence") : NULL;
    job_t j = {.fd = fd, .size = size, .first = first, .max_payload = max_payload, .readable = readable,
               .gap_max = gap_max, .whole_crc = whole_crc, .keys = keys.buf};
    uint64_t *offsets = NULL;
    Py_ssize_t got = 0;
    if (dests_seq == NULL) goto done;
    j.n = PySequence_Fast_GET_SIZE(offsets_seq);
    if (PySequence_Fast_GET_SIZE(dests_seq) != j.n || keys.len != j.n * REC_KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "read_records: %zd offsets, %zd destinations and %zd key bytes do not agree",
                     j.n, PySequence_Fast_GET_SIZE(dests_seq), keys.len);
        goto done;
    }
    size_t n = j.n > 0 ? (size_t)j.n : 1;
    offsets = PyMem_Calloc(n, sizeof(uint64_t));
    j.dests = PyMem_Calloc(n, sizeof(Py_buffer));
    j.heads = PyMem_Calloc(n, REC_HEADER);
    j.codes = PyMem_Malloc(n);
    j.order = PyMem_Calloc(n, sizeof(place_t));
    j.iov = PyMem_Calloc(3 * n, sizeof(struct iovec));
    j.run = PyMem_Calloc(n, sizeof(Py_ssize_t));
    j.scratch = PyMem_Malloc(gap_max > 0 ? (size_t)gap_max : 1);
    if (!offsets || !j.dests || !j.heads || !j.codes || !j.order || !j.iov || !j.run || !j.scratch) {
        PyErr_NoMemory();
        goto done;
    }
    memset(j.codes, OUT_PENDING, n);
    PyObject **offset_items = PySequence_Fast_ITEMS(offsets_seq);
    PyObject **dest_items = PySequence_Fast_ITEMS(dests_seq);
    for (Py_ssize_t i = 0; i < j.n; i++) {
        offsets[i] = PyLong_AsUnsignedLongLong(offset_items[i]);
        if (PyErr_Occurred()) goto done;
    }
    for (; got < j.n; got++) {
        PyObject *dest = dest_items[got];
        if ((PyList_Check(dest) || PyTuple_Check(dest)) && PySequence_Fast_GET_SIZE(dest) == 1)
            dest = PySequence_Fast_ITEMS(dest)[0]; /* an iovec of one segment */
        if (PyObject_GetBuffer(dest, &j.dests[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    }
    j.offsets = offsets;
    crc_init();
    Py_BEGIN_ALLOW_THREADS
    run_job(&j);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(y#i)", (const char *)j.codes, j.n, j.error);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&j.dests[i]);
    PyMem_Free(offsets);
    PyMem_Free(j.dests);
    PyMem_Free(j.heads);
    PyMem_Free(j.codes);
    PyMem_Free(j.order);
    PyMem_Free(j.iov);
    PyMem_Free(j.run);
    PyMem_Free(j.scratch);
    Py_XDECREF(dests_seq);
    Py_XDECREF(offsets_seq);
    PyBuffer_Release(&keys);
    return result;
}
#endif
