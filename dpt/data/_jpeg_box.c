/* A box of a JPEG, decoded without decoding the rest: the rows above it are only entropy-decoded
 * (jpeg_skip_scanlines), the columns beside it are not transformed (jpeg_crop_scanline), and the
 * rows below it are not read at all. Both calls are libjpeg-turbo's (>= 1.5); where they are
 * missing the module does not build and dpt.data.crop_decode decodes whole images instead.
 *
 * The pixels are the whole image's, cropped, bit for bit: the same library, the same defaults
 * (islow IDCT, fancy upsampling), the same DCT scaling (1/1, 1/2, 1/4, 1/8) as PIL's draft.
 * tests/test_jpeg_box.py holds them to PIL's, boxes at every edge and corner included.
 *
 * Anything this decoder does not take (not 8-bit, CMYK/YCCK, a libjpeg error, data that ends
 * before the image does) comes back as None so that the caller's general decoder decodes it or
 * names the problem in its own words. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jerror.h>
#include <jpeglib.h>

/* Fancy (triangle) upsampling of horizontally halved chroma (4:2:0, 4:2:2) makes each pixel from
 * its chroma sample and the next one out; at the edge of a cropped decode libjpeg repeats the edge
 * sample instead, and a crop one chroma sample wide is upsampled plainly. Decoding MARGIN pixels
 * (one chroma sample) beyond the box on each side, so at least 3 pixels, keeps the box's pixels
 * the whole image's (with 1, a 1-pixel box at the left edge is not: tests/test_jpeg_box.py).
 * jpeg_crop_scanline widens the left side further, to whole iMCU columns. */
#define MARGIN 2
/* Rows decoded per jpeg_read_scanlines call: fewer calls, the same pixels. */
#define ROWS 16

struct error_manager {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
};

static void on_error(j_common_ptr cinfo) {
  longjmp(((struct error_manager *)cinfo->err)->jump, 1);
}

/* Warnings (corrupt-data notes, extra bytes) are not printed: libjpeg's default writes the first
 * one to stderr from every worker. The pixels are libjpeg's either way, as PIL's are, but for data
 * that ends early: libjpeg would fill the rest with grey, which is an error here. */
static void on_message(j_common_ptr cinfo, int level) {
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) on_error(cinfo);
}

static int takes_colour_space(J_COLOR_SPACE space) {
  return space == JCS_YCbCr || space == JCS_GRAYSCALE || space == JCS_RGB;
}

/* Reads the header into cinfo (created by the caller, errors jumping to its setjmp). */
static int read_header(struct jpeg_decompress_struct *cinfo, const Py_buffer *data) {
  jpeg_mem_src(cinfo, (const unsigned char *)data->buf, (unsigned long)data->len);
  if (jpeg_read_header(cinfo, TRUE) != JPEG_HEADER_OK) return 0;
  return cinfo->data_precision == 8 && takes_colour_space(cinfo->jpeg_color_space);
}

struct box {
  int left, top, width, height, reduction;
};

/* Decodes `box` of the image at 1/reduction into out (height rows of width * 3 bytes). Returns
 * 1 on success, 0 where this decoder leaves the image to another. Runs without the GIL. */
static int decode_box(const Py_buffer *data, struct box box, unsigned char *out) {
  struct jpeg_decompress_struct cinfo;
  struct error_manager errors;
  JSAMPLE *volatile rows = NULL;
  cinfo.err = jpeg_std_error(&errors.pub);
  errors.pub.error_exit = on_error;
  errors.pub.emit_message = on_message;
  if (setjmp(errors.jump)) {
    free(rows);
    jpeg_destroy_decompress(&cinfo);
    return 0;
  }
  jpeg_create_decompress(&cinfo);
  if (!read_header(&cinfo, data)) {
    jpeg_destroy_decompress(&cinfo);
    return 0;
  }
  cinfo.out_color_space = JCS_RGB;
  cinfo.scale_num = 1;
  cinfo.scale_denom = (unsigned int)box.reduction;
  jpeg_start_decompress(&cinfo);
  int image_width = (int)cinfo.output_width, image_height = (int)cinfo.output_height;
  if (box.left < 0 || box.top < 0 || box.width <= 0 || box.height <= 0 ||
      box.left + box.width > image_width || box.top + box.height > image_height) {
    jpeg_destroy_decompress(&cinfo);
    return -1;
  }
  int first = box.left > MARGIN ? box.left - MARGIN : 0;
  int last = box.left + box.width + MARGIN < image_width ? box.left + box.width + MARGIN
                                                          : image_width;
  JDIMENSION x = (JDIMENSION)first, width = (JDIMENSION)(last - first);
  jpeg_crop_scanline(&cinfo, &x, &width); /* widens to whole iMCU columns on the left */
  size_t offset = (size_t)(box.left - (int)x) * 3, row_bytes = (size_t)box.width * 3;
  size_t decoded_bytes = (size_t)width * cinfo.output_components;
  rows = malloc(ROWS * decoded_bytes);
  if (rows == NULL) longjmp(errors.jump, 1);
  JSAMPROW pointers[ROWS];
  for (int i = 0; i < ROWS; i++) pointers[i] = rows + i * decoded_bytes;
  if (box.top > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)box.top);
  for (int done = 0; done < box.height;) {
    int wanted = box.height - done < ROWS ? box.height - done : ROWS;
    int got = (int)jpeg_read_scanlines(&cinfo, pointers, (JDIMENSION)wanted);
    if (got == 0) longjmp(errors.jump, 1); /* a memory source never suspends: never here */
    for (int i = 0; i < got; i++, done++)
      memcpy(out + (size_t)done * row_bytes, pointers[i] + offset, row_bytes);
  }
  free(rows);
  jpeg_destroy_decompress(&cinfo); /* the rows below the box are never decoded */
  return 1;
}

static PyObject *py_size(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer data;
  if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
  struct jpeg_decompress_struct cinfo;
  struct error_manager errors;
  cinfo.err = jpeg_std_error(&errors.pub);
  errors.pub.error_exit = on_error;
  errors.pub.emit_message = on_message;
  volatile int width = 0, height = 0; /* read after a longjmp */
  if (!setjmp(errors.jump)) {
    jpeg_create_decompress(&cinfo);
    if (read_header(&cinfo, &data)) {
      width = (int)cinfo.image_width;
      height = (int)cinfo.image_height;
    }
  }
  jpeg_destroy_decompress(&cinfo);
  PyBuffer_Release(&data);
  if (width == 0) Py_RETURN_NONE;
  return Py_BuildValue("(ii)", width, height);
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer data;
  struct box box;
  if (!PyArg_ParseTuple(args, "y*iiiii", &data, &box.left, &box.top, &box.width, &box.height,
                        &box.reduction))
    return NULL;
  if (box.reduction != 1 && box.reduction != 2 && box.reduction != 4 && box.reduction != 8) {
    PyBuffer_Release(&data);
    return PyErr_Format(PyExc_ValueError, "reduction must be 1, 2, 4 or 8, not %d",
                        box.reduction);
  }
  Py_ssize_t size = box.width > 0 && box.height > 0 ? (Py_ssize_t)box.width * box.height * 3 : 0;
  PyObject *out = PyByteArray_FromStringAndSize(NULL, size);
  if (out == NULL) {
    PyBuffer_Release(&data);
    return NULL;
  }
  int done;
  unsigned char *pixels = (unsigned char *)PyByteArray_AS_STRING(out);
  Py_BEGIN_ALLOW_THREADS /* other threads (a thread-pool loader) run while libjpeg does */
  done = decode_box(&data, box, pixels);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&data);
  if (done == 1) return out;
  Py_DECREF(out);
  if (done < 0)
    return PyErr_Format(PyExc_ValueError, "box (%d, %d, %d, %d) is not inside the image",
                        box.left, box.top, box.width, box.height);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"size", py_size, METH_VARARGS,
     "size(data) -> (width, height), or None for a JPEG this module does not decode."},
    {"decode", py_decode, METH_VARARGS,
     "decode(data, left, top, width, height, reduction) -> bytearray of (height, width, 3) RGB "
     "pixels of that box of the image decoded at 1/reduction, or None where this module leaves "
     "the image to another decoder."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_jpeg_box",
    .m_doc = "A box of a JPEG decoded alone (libjpeg-turbo).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__jpeg_box(void) { return PyModule_Create(&module); }
