/* Bound, the launcher's launch of fixed shape (_launcher.c includes this file; the two
 * are one translation unit, and jit_kernels/native.py hashes both into the build key). */
#define MAX_PARAM_BYTES 4096 /* the classic kernel parameter limit; bigger: launch.py's path */
#define MAX_PARAMS (MAX_PARAM_BYTES / 8) /* ArgPacker starts every parameter 8-byte aligned */
#define TENSOR_MAP_BYTES 128

#if PY_VERSION_HEX < 0x030B0000 /* public from 3.11 */
#define PyFloat_Pack4(x, p, le) _PyFloat_Pack4((x), (unsigned char *)(p), (le))
#define PyFloat_Pack8(x, p, le) _PyFloat_Pack8((x), (unsigned char *)(p), (le))
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "integers are written in host order: ArgPacker's '<' layout needs a little-endian host"
#endif

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  CUfunction function;
  unsigned int dims[7]; /* grid x, y, z, block x, y, z, dynamic shared memory bytes */
  int programmatic;
  Py_ssize_t members, params, size;
  char *codes;                  /* one ArgPacker code per member a call passes */
  unsigned int *offsets;        /* each such member's byte offset in the buffer */
  unsigned int *param_offsets;  /* each parameter's */
  PyObject *template;           /* bytes: the buffer with every other member packed */
  PyObject *on_error;           /* on_error(CUresult) raises the launch's error */
} Bound;

static int width(char code) {
  switch (code) {
    case 'b': case 'B': return 1;
    case 'h': case 'H': return 2;
    case 'i': case 'I': case 'f': return 4;
    case 'q': case 'Q': case 'd': case 'P': return 8;
    case 'M': return TENSOR_MAP_BYTES;
    default: return 0;
  }
}

static int range_error(Py_ssize_t i, char code) {
  PyErr_Format(PyExc_OverflowError, "kernel argument %zd is out of range for '%c'", i, code);
  return -1;
}

/* struct's standard-size conversions ('<' + code) of one member into ``at``. */
static int pack_member(char code, char *at, PyObject *v, Py_ssize_t i) {
  if (code == 'f' || code == 'd') {
    double x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred()) {
      return -1;
    }
    return code == 'f' ? PyFloat_Pack4(x, at, 1) : PyFloat_Pack8(x, at, 1);
  }
  if (code == 'M') {
    char *bytes;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(v, &bytes, &n) < 0) {
      return -1;
    }
    memcpy(at, bytes, (size_t)(n < TENSOR_MAP_BYTES ? n : TENSOR_MAP_BYTES)); /* '128s' */
    return 0;
  }
  if (code == 'P' || code == 'Q') {
    PyObject *index = PyNumber_Index(v); /* as struct: any __index__ (a new reference) */
    if (index == NULL) {
      return -1;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
      return -1;
    }
    memcpy(at, &u, 8);
    return 0;
  }
  long long x = PyLong_AsLongLong(v);
  if (x == -1 && PyErr_Occurred()) {
    return -1;
  }
  switch (code) {
    case 'q': memcpy(at, &x, 8); return 0;
    case 'i': { if (x < INT_MIN || x > INT_MAX) return range_error(i, code);
                int y = (int)x; memcpy(at, &y, 4); return 0; }
    case 'I': { if (x < 0 || x > UINT_MAX) return range_error(i, code);
                unsigned int y = (unsigned int)x; memcpy(at, &y, 4); return 0; }
    case 'h': { if (x < SHRT_MIN || x > SHRT_MAX) return range_error(i, code);
                short y = (short)x; memcpy(at, &y, 2); return 0; }
    case 'H': { if (x < 0 || x > USHRT_MAX) return range_error(i, code);
                unsigned short y = (unsigned short)x; memcpy(at, &y, 2); return 0; }
    case 'b': { if (x < SCHAR_MIN || x > SCHAR_MAX) return range_error(i, code);
                *at = (char)x; return 0; }
    default: { if (x < 0 || x > UCHAR_MAX) return range_error(i, code); /* 'B' */
               *at = (char)x; return 0; }
  }
}

static CUresult bound_launch(Bound *self, CUstream stream, void **params) {
  CUresult err;
  const unsigned int *d = self->dims;
  if (self->programmatic) {
    CUlaunchAttribute attribute;
    memset(&attribute, 0, sizeof attribute);
    attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig config = {d[0], d[1], d[2], d[3], d[4], d[5], d[6], stream, &attribute, 1};
    Py_BEGIN_ALLOW_THREADS
    err = cu_launch_ex(&config, self->function, params, NULL);
    Py_END_ALLOW_THREADS
  } else {
    Py_BEGIN_ALLOW_THREADS
    err = cu_launch(self->function, d[0], d[1], d[2], d[3], d[4], d[5], d[6], stream, params,
                    NULL);
    Py_END_ALLOW_THREADS
  }
  return err;
}

static PyObject *bound_call(PyObject *callable, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames) {
  Bound *self = (Bound *)callable;
  if (PyVectorcall_NARGS(nargsf) != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
    PyErr_SetString(PyExc_TypeError, "a bound launch takes (stream, values)");
    return NULL;
  }
  CUstream stream = (CUstream)PyLong_AsVoidPtr(args[0]);
  if (stream == NULL && PyErr_Occurred()) {
    return NULL;
  }
  PyObject *values = args[1];
  if (!PyTuple_Check(values) || PyTuple_GET_SIZE(values) != self->members) {
    PyErr_Format(PyExc_TypeError, "a bound launch takes a tuple of %zd values", self->members);
    return NULL;
  }
  _Alignas(64) char data[MAX_PARAM_BYTES];
  void *params[MAX_PARAMS];
  memcpy(data, PyBytes_AS_STRING(self->template), (size_t)self->size);
  for (Py_ssize_t i = 0; i < self->members; ++i) {
    PyObject *v = PyTuple_GET_ITEM(values, i);
    if (pack_member(self->codes[i], data + self->offsets[i], v, i) < 0) {
      return NULL;
    }
  }
  for (Py_ssize_t j = 0; j < self->params; ++j) {
    params[j] = data + self->param_offsets[j];
  }
  if (cu_launch == NULL && open_driver() < 0) {
    return NULL;
  }
  CUresult err = bound_launch(self, stream, params);
  if (err != 0) {
    PyObject *raised = PyObject_CallFunction(self->on_error, "i", err);
    Py_XDECREF(raised);
    if (raised != NULL) { /* on_error must raise; the launch failed all the same */
      PyErr_Format(PyExc_RuntimeError, "kernel launch failed: CUresult %d", err);
    }
    return NULL;
  }
  Py_RETURN_NONE;
}

/* ``items`` (a tuple of ints, each below ``limit``) into a new C array; NULL on error. */
static unsigned int *offsets_of(PyObject *items, Py_ssize_t count, Py_ssize_t limit) {
  if (!PyTuple_Check(items) || PyTuple_GET_SIZE(items) != count) {
    PyErr_SetString(PyExc_ValueError, "offsets: a tuple of one int per member or parameter");
    return NULL;
  }
  unsigned int *out = PyMem_Malloc(sizeof(unsigned int) * (size_t)(count ? count : 1));
  if (out == NULL) {
    PyErr_NoMemory();
    return NULL;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(items, i));
    if (v < 0 || v >= limit) {
      if (!PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "offset %zd is outside the %zd-byte buffer", v, limit);
      }
      PyMem_Free(out);
      return NULL;
    }
    out[i] = (unsigned int)v;
  }
  return out;
}

static int bound_fill(Bound *self, PyObject *codes, PyObject *offsets, PyObject *param_offsets) {
  self->members = PyBytes_GET_SIZE(codes);
  self->size = PyBytes_GET_SIZE(self->template);
  self->params = PyTuple_Check(param_offsets) ? PyTuple_GET_SIZE(param_offsets) : -1;
  if (self->size < 0 || self->size > MAX_PARAM_BYTES || self->params < 0 ||
      self->params > MAX_PARAMS) {
    PyErr_Format(PyExc_ValueError, "a bound launch packs at most %d bytes", MAX_PARAM_BYTES);
    return -1;
  }
  self->codes = PyMem_Malloc((size_t)self->members + 1);
  if (self->codes == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  memcpy(self->codes, PyBytes_AS_STRING(codes), (size_t)self->members);
  self->offsets = offsets_of(offsets, self->members, self->size);
  if (self->offsets == NULL) {
    return -1;
  }
  for (Py_ssize_t i = 0; i < self->members; ++i) {
    int w = width(self->codes[i]);
    if (w == 0 || self->offsets[i] + (unsigned int)w > (unsigned int)self->size) {
      PyErr_Format(PyExc_ValueError, "member %zd: unknown code or past the buffer", i);
      return -1;
    }
  }
  self->param_offsets = offsets_of(param_offsets, self->params, self->size ? self->size : 1);
  return self->param_offsets == NULL ? -1 : 0;
}

static PyObject *bound_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  PyObject *function, *codes, *offsets, *param_offsets, *template, *on_error;
  Py_ssize_t dims[7];
  int programmatic;
  if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
    PyErr_SetString(PyExc_TypeError, "Bound takes positional arguments only");
    return NULL;
  }
  if (!PyArg_ParseTuple(args, "OnnnnnnnpSOOSO:Bound", &function, &dims[0], &dims[1], &dims[2],
                        &dims[3], &dims[4], &dims[5], &dims[6], &programmatic, &codes,
                        &offsets, &param_offsets, &template, &on_error)) {
    return NULL;
  }
  for (int i = 0; i < 7; ++i) {
    if (dims[i] < 0 || (size_t)dims[i] > UINT_MAX) {
      PyErr_SetString(PyExc_OverflowError, "a grid, block or shared memory size exceeds 32 bits");
      return NULL;
    }
  }
  Bound *self = (Bound *)type->tp_alloc(type, 0);
  if (self == NULL) {
    return NULL;
  }
  self->vectorcall = bound_call;
  self->function = (CUfunction)PyLong_AsVoidPtr(function);
  for (int i = 0; i < 7; ++i) {
    self->dims[i] = (unsigned int)dims[i];
  }
  self->programmatic = programmatic;
  Py_INCREF(template);
  self->template = template;
  Py_INCREF(on_error);
  self->on_error = on_error;
  if (PyErr_Occurred() || bound_fill(self, codes, offsets, param_offsets) < 0) {
    Py_DECREF(self);
    return NULL;
  }
  return (PyObject *)self;
}

static int bound_traverse(Bound *self, visitproc visit, void *arg) {
  Py_VISIT(self->on_error);
  return 0;
}

static int bound_clear(Bound *self) {
  Py_CLEAR(self->template);
  Py_CLEAR(self->on_error);
  return 0;
}

static void bound_dealloc(Bound *self) {
  PyObject_GC_UnTrack(self);
  bound_clear(self);
  PyMem_Free(self->codes);
  PyMem_Free(self->offsets);
  PyMem_Free(self->param_offsets);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject BoundType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "jit_kernels._launcher.Bound",
    .tp_basicsize = sizeof(Bound),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "a launch of fixed shape: call it with (stream, values)",
    .tp_new = bound_new,
    .tp_dealloc = (destructor)bound_dealloc,
    .tp_traverse = (traverseproc)bound_traverse,
    .tp_clear = (inquiry)bound_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Bound, vectorcall),
};
