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
 *
 * The symbols are resolved on first use (libcuda(), as open_driver does), so the module
 * still imports without a driver; a call there raises RuntimeError.
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

static struct {
  LibraryLoadData library_load;
  LibraryGetKernel library_kernel;
  KernelGetFunction kernel_function;
  ModuleLoadData module_load;
  ModuleGetFunction module_function;
  FuncSetAttribute set_attribute;
  FuncGetAttribute get_attribute;
  OccupancyBlocks blocks;
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
  /* cuLibrary* are CUDA 12.0's; the others older. */
  void *found[9] = {dlsym(lib, "cuLibraryLoadData"), dlsym(lib, "cuLibraryGetKernel"),
                    dlsym(lib, "cuKernelGetFunction"), dlsym(lib, "cuModuleLoadData"),
                    dlsym(lib, "cuModuleGetFunction"), dlsym(lib, "cuFuncSetAttribute"),
                    dlsym(lib, "cuFuncGetAttribute"),
                    dlsym(lib, "cuOccupancyMaxActiveBlocksPerMultiprocessor"),
                    dlsym(lib, "cuOccupancyMaxActiveClusters")};
  for (int i = 0; i < 9; ++i) {
    if (found[i] == NULL) {
      PyErr_SetString(PyExc_RuntimeError, "libcuda.so.1 lacks the CUDA 12 library API");
      return -1;
    }
  }
  cu.library_load = (LibraryLoadData)found[0];
  cu.library_kernel = (LibraryGetKernel)found[1];
  cu.kernel_function = (KernelGetFunction)found[2];
  cu.module_load = (ModuleLoadData)found[3];
  cu.module_function = (ModuleGetFunction)found[4];
  cu.set_attribute = (FuncSetAttribute)found[5];
  cu.get_attribute = (FuncGetAttribute)found[6];
  cu.blocks = (OccupancyBlocks)found[7];
  cu.clusters = (OccupancyClusters)found[8];
  return 0;
}

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
  if (err == 0) {
    err = cu.library_load(&library, image.buf, NULL, NULL, 0, NULL, NULL, 0);
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
  if (err == 0) {
    err = cu.module_load(&handle, image.buf);
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
  return PyLong_FromLong(cu.set_attribute(f, attribute, value));
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
       "clusters(function, cluster, threads, smem) -> (CUresult, resident clusters)"},
