/* The driver calls the engine makes besides launches (included by _launcher.c; Python side:
 * jit_kernels/driver.py). Through here a first call loads its kernels without importing
 * cuda-python's driver module, 27 of the 34-42 ms of a warm first call on the H200 host
 * (2026-12-02). Every function returns the CUresult first; handles are ints.
 *
 *   load_library(cubin, entry) -> (err, library, function)   cuLibraryLoadData + GetKernel
 *   load_module(image, entry) -> (err, module, function)     cuModuleLoadData (PTX or cubin)
 *   set_attribute(function, attribute, value) -> err         cuFuncSetAttribute
 *   get_attribute(function, attribute) -> (err, value)       cuFuncGetAttribute
 *   blocks_per_sm(function, threads, smem) -> (err, n)       cuOccupancyMaxActiveBlocksPerMultiprocessor
 *   clusters(function, cluster, threads, smem) -> (err, n)   cuOccupancyMaxActiveClusters
 *   encode_tiled(dtype, address, dims, strides, box, element_strides, interleave, swizzle,
 *                promotion, oob_fill) -> (err, 128 bytes)  cuTensorMapEncodeTiled (rank: len(dims))
 *
 * The symbols are resolved on first use (libcuda(), as open_driver does), so the module
 * still imports without a driver; a call there raises RuntimeError.
 *
 * The two loads and set_attribute (a loaded kernel's shared-memory opt-in) run with this
 * thread's stream-capture mode relaxed: a load is no stream operation, but during a capture
 * in torch's default global mode the driver refuses it (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
 * the capture invalidated), and a serving engine's capture of a batch size it never ran
 * eagerly is a kernel's first use.
 */
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUmod_st *CUmodule;
/* cuda.h, CUlaunchAttributeID_enum: CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4; its value is
 * the union's first member, struct { unsigned int x, y, z; } clusterDim. */
#define CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION 4

typedef CUresult (*LibraryLoadData)(CUlibrary *, const void *, void *, void **, unsigned int, void *,
                                    void **, unsigned int);
typedef CUresult (*LibraryGetKernel)(CUkernel *, CUlibrary, const char *);
typedef CUresult (*KernelGetFunction)(CUfunction *, CUkernel);
typedef CUresult (*ModuleLoadData)(CUmodule *, const void *);
typedef CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
typedef CUresult (*FuncSetAttribute)(CUfunction, int, int);
typedef CUresult (*FuncGetAttribute)(int *, int, CUfunction);
typedef CUresult (*OccupancyBlocks)(int *, CUfunction, int, size_t);
typedef CUresult (*OccupancyClusters)(int *, CUfunction, const CUlaunchConfig *);
typedef CUresult (*ExchangeCaptureMode)(int *); /* cuThreadExchangeStreamCaptureMode */
#define CU_STREAM_CAPTURE_MODE_RELAXED 2        /* cuda.h, CUstreamCaptureMode */
/* cuda.h: CUtensorMap is 128 bytes, 64-byte aligned; the enums are ints. */
typedef struct {
  _Alignas(64) unsigned long long opaque[16];
} CUtensorMap;
typedef CUresult (*EncodeTiled)(CUtensorMap *, int, unsigned int, void *, const unsigned long long *,
                                const unsigned long long *, const unsigned int *, const unsigned int *,
                                int, int, int, int);

static struct {
  LibraryLoadData library_load;
  LibraryGetKernel library_kernel;
  KernelGetFunction kernel_function;
  ModuleLoadData module_load;
  ModuleGetFunction module_function;
  FuncSetAttribute set_attribute;
  FuncGetAttribute get_attribute;
  OccupancyBlocks blocks;
  EncodeTiled encode_tiled;
  ExchangeCaptureMode exchange_capture_mode;
  OccupancyClusters clusters; /* set last, under the GIL: the mark that all are set */
} cu;

static int open_loader(void) {
  if (cu.clusters != NULL) {
    return 0;
  }
  void *lib = libcuda();
  if (lib == NULL) {
    return -1;
  }
  /* cuLibrary* and cuTensorMapEncodeTiled are CUDA 12.0's; the others older. */
  void *found[11] = {dlsym(lib, "cuTensorMapEncodeTiled"), dlsym(lib, "cuLibraryLoadData"),
                     dlsym(lib, "cuLibraryGetKernel"),
                    dlsym(lib, "cuKernelGetFunction"), dlsym(lib, "cuModuleLoadData"),
                    dlsym(lib, "cuModuleGetFunction"), dlsym(lib, "cuFuncSetAttribute"),
                    dlsym(lib, "cuFuncGetAttribute"),
                    dlsym(lib, "cuOccupancyMaxActiveBlocksPerMultiprocessor"),
                    dlsym(lib, "cuThreadExchangeStreamCaptureMode"),
                    dlsym(lib, "cuOccupancyMaxActiveClusters")};
  for (int i = 0; i < 11; ++i) {
    if (found[i] == NULL) {
      PyErr_SetString(PyExc_RuntimeError, "libcuda.so.1 lacks the CUDA 12 library API");
      return -1;
    }
  }
  cu.encode_tiled = (EncodeTiled)found[0];
  cu.library_load = (LibraryLoadData)found[1];
  cu.library_kernel = (LibraryGetKernel)found[2];
  cu.kernel_function = (KernelGetFunction)found[3];
  cu.module_load = (ModuleLoadData)found[4];
  cu.module_function = (ModuleGetFunction)found[5];
  cu.set_attribute = (FuncSetAttribute)found[6];
  cu.get_attribute = (FuncGetAttribute)found[7];
  cu.blocks = (OccupancyBlocks)found[8];
  cu.exchange_capture_mode = (ExchangeCaptureMode)found[9];
  cu.clusters = (OccupancyClusters)found[10];
  return 0;
}

/* Relax this thread's capture mode (see the top); *previous: the mode to restore. */
static CUresult relax_capture(int *previous) {
  *previous = CU_STREAM_CAPTURE_MODE_RELAXED;
  return cu.exchange_capture_mode(previous);
}

static void restore_capture(int previous) { cu.exchange_capture_mode(&previous); }

/* PyArg "O&" converter: an int to a CUfunction handle, after the driver is opened. */
static int function_arg(PyObject *obj, void *out) {
  *(CUfunction *)out = (CUfunction)PyLong_AsVoidPtr(obj);
  return !PyErr_Occurred() && open_loader() == 0;
}

static PyObject *load_library(PyObject *module, PyObject *args) {
  Py_buffer image;
  const char *entry;
  if (!PyArg_ParseTuple(args, "y*y", &image, &entry)) {
    return NULL;
  }
  CUlibrary library = NULL;
  CUkernel kernel = NULL;
  CUfunction function = NULL;
  CUresult err = open_loader() < 0 ? -1 : 0;
  int mode;
  if (err == 0 && (err = relax_capture(&mode)) == 0) {
    err = cu.library_load(&library, image.buf, NULL, NULL, 0, NULL, NULL, 0);
    restore_capture(mode);
  }
  if (err == 0) {
    err = cu.library_kernel(&kernel, library, entry);
  }
  if (err == 0) {
    err = cu.kernel_function(&function, kernel);
  }
  PyBuffer_Release(&image);
  if (err == -1) {
    return NULL;
  }
  return Py_BuildValue("(iNN)", err, PyLong_FromVoidPtr(library), PyLong_FromVoidPtr(function));
}

static PyObject *load_module(PyObject *module, PyObject *args) {
  Py_buffer image;
  const char *entry;
  if (!PyArg_ParseTuple(args, "y*y", &image, &entry)) {
    return NULL;
  }
  CUmodule handle = NULL;
  CUfunction function = NULL;
  CUresult err = open_loader() < 0 ? -1 : 0;
  int mode;
  if (err == 0 && (err = relax_capture(&mode)) == 0) {
    err = cu.module_load(&handle, image.buf);
    restore_capture(mode);
  }
  if (err == 0) {
    err = cu.module_function(&function, handle, entry);
  }
  PyBuffer_Release(&image);
  if (err == -1) {
    return NULL;
  }
  return Py_BuildValue("(iNN)", err, PyLong_FromVoidPtr(handle), PyLong_FromVoidPtr(function));
}

static PyObject *set_attribute(PyObject *module, PyObject *args) {
  CUfunction f;
  int attribute, value;
  if (!PyArg_ParseTuple(args, "O&ii", function_arg, &f, &attribute, &value)) {
    return NULL;
  }
  int mode;
  CUresult err = relax_capture(&mode); /* (part of a kernel's load: see the top) */
  if (err == 0) {
    err = cu.set_attribute(f, attribute, value);
    restore_capture(mode);
  }
  return PyLong_FromLong(err);
}

static PyObject *get_attribute(PyObject *module, PyObject *args) {
  CUfunction f;
  int attribute, value = 0;
  if (!PyArg_ParseTuple(args, "O&i", function_arg, &f, &attribute)) {
    return NULL;
  }
  CUresult err = cu.get_attribute(&value, attribute, f);
  return Py_BuildValue("(ii)", err, value);
}

static PyObject *blocks_per_sm(PyObject *module, PyObject *args) {
  CUfunction f;
  int threads, n = 0;
  Py_ssize_t smem;
  if (!PyArg_ParseTuple(args, "O&in", function_arg, &f, &threads, &smem)) {
    return NULL;
  }
  CUresult err = cu.blocks(&n, f, threads, (size_t)smem);
  return Py_BuildValue("(ii)", err, n);
}

static PyObject *clusters(PyObject *module, PyObject *args) {
  CUfunction f;
  unsigned int cluster, threads, smem;
  int n = 0;
  if (!PyArg_ParseTuple(args, "O&III", function_arg, &f, &cluster, &threads, &smem)) {
    return NULL;
  }
  CUlaunchAttribute attribute;
  memset(&attribute, 0, sizeof attribute);
  attribute.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
  unsigned int dims[3] = {cluster, 1, 1};
  memcpy(attribute.value.pad, dims, sizeof dims);
  CUlaunchConfig config = {cluster, 1, 1, threads, 1, 1, smem, NULL, &attribute, 1};
  CUresult err = cu.clusters(&n, f, &config);
  return Py_BuildValue("(ii)", err, n);
}

/* A tuple of ints into out[0..n), each at most max; -1 with an error set otherwise. */
static int int_tuple(PyObject *tuple, unsigned long long *out, Py_ssize_t n, unsigned long long max,
                     const char *what) {
  if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != n) {
    PyErr_Format(PyExc_ValueError, "%s: a tuple of %zd ints", what, n);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(tuple, i));
    if (PyErr_Occurred()) {
      return -1;
    }
    if (v > max) {
      PyErr_Format(PyExc_OverflowError, "%s[%zd] = %llu exceeds %llu", what, i, v, max);
      return -1;
    }
    out[i] = v;
  }
  return 0;
}

static PyObject *encode_tiled(PyObject *module, PyObject *args) {
  int dtype, interleave, swizzle, promotion, oob;
  PyObject *address, *dims, *strides, *box, *element_strides;
  if (!PyArg_ParseTuple(args, "iOO!O!O!O!iiii", &dtype, &address, &PyTuple_Type, &dims, &PyTuple_Type,
                        &strides, &PyTuple_Type, &box, &PyTuple_Type, &element_strides, &interleave,
                        &swizzle, &promotion, &oob) ||
      open_loader() < 0) {
    return NULL;
  }
  Py_ssize_t rank = PyTuple_GET_SIZE(dims);
  if (rank < 1 || rank > 5) {
    return PyErr_Format(PyExc_ValueError, "a tensor map has rank 1 to 5, got %zd", rank);
  }
  unsigned long long dim[5], stride[4], box64[5], estride64[5];
  unsigned int box32[5], estride32[5];
  if (int_tuple(dims, dim, rank, ULLONG_MAX, "dims") < 0 ||
      int_tuple(strides, stride, rank - 1, ULLONG_MAX, "strides") < 0 ||
      int_tuple(box, box64, rank, UINT_MAX, "box") < 0 ||
      int_tuple(element_strides, estride64, rank, UINT_MAX, "element_strides") < 0) {
    return NULL;
  }
  for (Py_ssize_t i = 0; i < rank; ++i) {
    box32[i] = (unsigned int)box64[i];
    estride32[i] = (unsigned int)estride64[i];
  }
  void *base = PyLong_AsVoidPtr(address);
  if (PyErr_Occurred()) {
    return NULL;
  }
  CUtensorMap map;
  memset(&map, 0, sizeof map);
  CUresult err = cu.encode_tiled(&map, dtype, (unsigned int)rank, base, dim, stride, box32, estride32,
                                 interleave, swizzle, promotion, oob);
  return Py_BuildValue("(iy#)", err, (const char *)map.opaque, (Py_ssize_t)sizeof map.opaque);
}

#define DRIVER_METHODS                                                                          \
  {"load_library", load_library, METH_VARARGS,                                                \
   "load_library(cubin, entry) -> (CUresult, library, function)"},                           \
      {"load_module", load_module, METH_VARARGS,                                              \
       "load_module(image, entry) -> (CUresult, module, function)"},                          \
      {"set_attribute", set_attribute, METH_VARARGS,                                          \
       "set_attribute(function, attribute, value) -> CUresult"},                              \
      {"get_attribute", get_attribute, METH_VARARGS,                                          \
       "get_attribute(function, attribute) -> (CUresult, value)"},                            \
      {"blocks_per_sm", blocks_per_sm, METH_VARARGS,                                          \
       "blocks_per_sm(function, threads, smem) -> (CUresult, blocks)"},                       \
      {"clusters", clusters, METH_VARARGS,                                                    \
       "clusters(function, cluster, threads, smem) -> (CUresult, resident clusters)"},        \
      {"encode_tiled", encode_tiled, METH_VARARGS,                                            \
       "encode_tiled(dtype, address, dims, strides, box, element_strides, interleave, "       \
       "swizzle, promotion, oob_fill) -> (CUresult, 128-byte CUtensorMap)"},
