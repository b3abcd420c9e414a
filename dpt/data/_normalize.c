/* A resampled sample's last step in one pass: uint8 (H, W, 3) pixels, flipped left-right or not,
 * to planar float32 (3, H, W), each value (x * scale[c]) + bias[c], rounded after the product and
 * again after the sum, as torch's mul_ then add_ round (-ffp-contract=off: no fused multiply-add
 * on any target). dpt.data.crop_decode's torch path does the same in a flip copy, a converting
 * copy and two passes; tests/test_crop_decode.py holds the two equal, bit for bit.
 *
 * Each row is de-interleaved into the three planes by a loop the compiler vectorizes (built with
 * -O3; an AVX2 clone where the CPU has it); a flipped row is converted forward, then copied
 * reversed, since a loop that reads pixels backwards is not vectorized. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* The widest row flipped through the stack buffer; wider ones are flipped after the pass. */
#define MAX_STACK_WIDTH 1024

static void convert_row(const uint8_t *restrict row, Py_ssize_t width, const float *scale,
                        const float *bias, float *restrict r, float *restrict g,
                        float *restrict b) {
  const float s0 = scale[0], s1 = scale[1], s2 = scale[2];
  const float b0 = bias[0], b1 = bias[1], b2 = bias[2];
  for (Py_ssize_t x = 0; x < width; x++) {
    const uint8_t *pixel = row + x * 3;
    r[x] = (float)pixel[0] * s0 + b0;
    g[x] = (float)pixel[1] * s1 + b1;
    b[x] = (float)pixel[2] * s2 + b2;
  }
}

static void reverse_into(const float *restrict in, Py_ssize_t width, float *restrict out) {
  for (Py_ssize_t x = 0; x < width; x++) out[x] = in[width - 1 - x];
}

static void reverse_in_place(float *row, Py_ssize_t width) {
  for (Py_ssize_t x = 0; x < width / 2; x++) {
    float kept = row[x];
    row[x] = row[width - 1 - x];
    row[width - 1 - x] = kept;
  }
}

__attribute__((target_clones("avx2", "default"))) static void
normalize(const uint8_t *src, Py_ssize_t height, Py_ssize_t width, int flip, const float *scale,
          const float *bias, float *out) {
  const Py_ssize_t plane = height * width;
  float buffer[3 * MAX_STACK_WIDTH];
  for (Py_ssize_t y = 0; y < height; y++) {
    const uint8_t *row = src + y * width * 3;
    float *first = out + y * width;
    if (flip && width <= MAX_STACK_WIDTH) {
      convert_row(row, width, scale, bias, buffer, buffer + width, buffer + 2 * width);
      for (int c = 0; c < 3; c++) reverse_into(buffer + c * width, width, first + c * plane);
      continue;
    }
    convert_row(row, width, scale, bias, first, first + plane, first + 2 * plane);
    if (flip)
      for (int c = 0; c < 3; c++) reverse_in_place(first + c * plane, width);
  }
}

static PyObject *py_normalize(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer src, out;
  Py_ssize_t height, width;
  int flip;
  float scale[3], bias[3];
  if (!PyArg_ParseTuple(args, "y*nnpffffffw*", &src, &height, &width, &flip, &scale[0],
                        &scale[1], &scale[2], &bias[0], &bias[1], &bias[2], &out))
    return NULL;
  PyObject *result = Py_None;
  if (height < 0 || width < 0 || src.len != height * width * 3 ||
      out.len != height * width * 3 * (Py_ssize_t)sizeof(float)) {
    PyErr_Format(PyExc_ValueError,
                 "normalize: %zd bytes in and %zd out for a %zd x %zd image (3 channels)",
                 src.len, out.len, height, width);
    result = NULL;
  } else {
    Py_BEGIN_ALLOW_THREADS /* other threads (a thread-pool loader) run meanwhile */
    normalize(src.buf, height, width, flip, scale, bias, out.buf);
    Py_END_ALLOW_THREADS
    Py_INCREF(result);
  }
  PyBuffer_Release(&src);
  PyBuffer_Release(&out);
  return result;
}

static PyMethodDef methods[] = {
    {"normalize", py_normalize, METH_VARARGS,
     "normalize(src, height, width, flip, s0, s1, s2, b0, b1, b2, out) -> None: the uint8 "
     "(height, width, 3) pixels in src, mirrored left-right where flip is true, written to out as "
     "float32 (3, height, width) planes, x * s[c] + b[c]. Both buffers C-contiguous."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_normalize",
    .m_doc = "uint8 HWC pixels to normalized float32 CHW in one vectorized pass.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__normalize(void) { return PyModule_Create(&module); }
