/* Parting an image's channels (H x W x C -> C x H x W) and interleaving them again, in one pass.
 *
 * numpy's transposing copy moves one byte at a time (about 2-3 GB/s on one core: ~65 us for a
 * 256x256x3 image, against ~12 us for a plain copy of it); these loops are simple enough for the
 * compiler to vectorise (shuffles on x86 with AVX2, LD3/ST3 on ARM): ~20-25 us.  The GIL is
 * released around each copy, so threads part channels side by side.  Where this module does not
 * build (no compiler), packed_formats.native falls back to numpy and says so in its docstring.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define PF_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef PF_CLONES
#define PF_CLONES
#endif

PF_CLONES static void
part3(const uint8_t *restrict src, uint8_t *restrict dst, Py_ssize_t pixels)
{
    uint8_t *restrict a = dst, *restrict b = dst + pixels, *restrict c = dst + 2 * pixels;
    for (Py_ssize_t i = 0; i < pixels; i++) {
        a[i] = src[3 * i];
        b[i] = src[3 * i + 1];
        c[i] = src[3 * i + 2];
    }
}

PF_CLONES static void
join3(const uint8_t *restrict src, uint8_t *restrict dst, Py_ssize_t pixels)
{
    const uint8_t *restrict a = src, *restrict b = src + pixels, *restrict c = src + 2 * pixels;
    for (Py_ssize_t i = 0; i < pixels; i++) {
        dst[3 * i] = a[i];
        dst[3 * i + 1] = b[i];
        dst[3 * i + 2] = c[i];
    }
}

static void
part_any(const uint8_t *src, uint8_t *dst, Py_ssize_t pixels, Py_ssize_t channels)
{
    for (Py_ssize_t k = 0; k < channels; k++)
        for (Py_ssize_t i = 0; i < pixels; i++)
            dst[k * pixels + i] = src[i * channels + k];
}

static void
join_any(const uint8_t *src, uint8_t *dst, Py_ssize_t pixels, Py_ssize_t channels)
{
    for (Py_ssize_t k = 0; k < channels; k++)
        for (Py_ssize_t i = 0; i < pixels; i++)
            dst[i * channels + k] = src[k * pixels + i];
}

/* gather(src, starts, dst, places, nbytes, channels, planar): for each j, the image of ``nbytes`` at byte
 * starts[j] of ``src`` into the row places[j] of ``dst`` (rows of ``nbytes`` one after the other), its
 * ``channels`` parted (planar true: H x W x C -> C x H x W) or joined (false: the inverse).  starts and
 * places are int64 buffers of one length; every image must lie inside src and every row inside dst. */
static PyObject *
gather(PyObject *self, PyObject *args)
{
    PyObject *objects[4];
    Py_ssize_t nbytes, channels;
    int planar;
    Py_buffer views[4];  /* src, starts, dst, places */
    int flags[4] = {PyBUF_SIMPLE, PyBUF_SIMPLE, PyBUF_SIMPLE | PyBUF_WRITABLE, PyBUF_SIMPLE};
    int held = 0;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "OOOOnnp:gather", &objects[0], &objects[1], &objects[2], &objects[3],
                          &nbytes, &channels, &planar))
        return NULL;
    for (; held < 4; held++)
        if (PyObject_GetBuffer(objects[held], &views[held], flags[held]) < 0)
            goto done;
    Py_ssize_t count = views[1].len / (Py_ssize_t)sizeof(int64_t);
    if (channels < 1 || nbytes < 1 || nbytes % channels || views[1].len % (Py_ssize_t)sizeof(int64_t)
        || views[3].len != views[1].len) {
        PyErr_Format(PyExc_ValueError, "cannot gather images of %zd bytes and %zd channels from %zd starts "
                     "into %zd places", nbytes, channels, count, views[3].len / (Py_ssize_t)sizeof(int64_t));
        goto done;
    }
    const int64_t *starts = views[1].buf, *places = views[3].buf;
    Py_ssize_t rows = views[2].len / nbytes;
    for (Py_ssize_t j = 0; j < count; j++) {
        if (starts[j] < 0 || starts[j] > views[0].len - nbytes || places[j] < 0 || places[j] >= rows) {
            PyErr_Format(PyExc_ValueError, "cannot gather an image of %zd bytes at byte %lld of %zd into row "
                         "%lld of %zd", nbytes, (long long)starts[j], views[0].len, (long long)places[j], rows);
            goto done;
        }
    }
    const uint8_t *src = views[0].buf;
    uint8_t *dst = views[2].buf;
    Py_ssize_t pixels = nbytes / channels;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < count; j++) {
        const uint8_t *from = src + starts[j];
        uint8_t *to = dst + places[j] * nbytes;
        if (channels == 1)
            memcpy(to, from, (size_t)nbytes);
        else if (channels == 3)
            (planar ? part3 : join3)(from, to, pixels);
        else
            (planar ? part_any : join_any)(from, to, pixels, channels);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    while (held > 0)
        PyBuffer_Release(&views[--held]);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(src, starts, dst, places, nbytes, channels, planar): the images of nbytes at byte starts[j] of "
     "src into rows places[j] of dst, their channels parted (planar) or joined, the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pixels", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__pixels(void)
{
    return PyModule_Create(&module);
}
