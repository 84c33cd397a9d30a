/* The engine's compiled launcher: one C call per kernel launch instead of cuda-python's
 * argument conversions (jit_kernels/native.py builds and imports it; launch.py uses it).
 *
 *   launch(function, gx, gy, gz, bx, by, bz, smem, stream, params) -> CUresult (int)
 *   launch_programmatic(<the same>) -> CUresult (int)
 *   Bound(function, gx, gy, gz, bx, by, bz, smem, programmatic, codes, offsets,
 *         param_offsets, template, on_error)(stream, values) -> None
 *   load_library, load_module, set/get_attribute, blocks_per_sm, clusters: _launcher_driver.h
 *
 * function: a CUfunction handle as an int; stream: a raw CUstream (torch's cudaStream_t)
 * as an int; params: the address of the kernel's void* argument array (ArgPacker.pack).
 * launch_programmatic is cuLaunchKernelEx with programmatic stream serialization allowed
 * (a programmatic dependent launch), its config built here on the stack per call.
 *
 * Bound is a launch whose shape is fixed (LoadedKernel.bind): a call copies ``template``
 * (the parameter buffer with the members fixed at binding packed) onto this call's stack,
 * packs ``values`` (the other members, ``codes``, at the ``offsets`` ArgPacker computed)
 * with struct's conversions and checks, and launches; ``on_error(CUresult)`` raises when
 * the driver refuses. Packing here instead of through struct.pack_into saves ~1 us of a
 * 37-argument launch (CPU), and the stack buffer needs no per-thread copy.
 *
 * No CUDA header is needed: the few driver types used are declared below, copied from
 * cuda.h (CUDA 12.x and 13.0, where they are part of the driver's ABI);
 * tests/test_native_launch.py compares their layout with cuda.h where one is installed.
 * The driver is opened on the first launch (dlopen libcuda.so.1), so the module imports
 * on a machine without one; a launch there raises RuntimeError. ``use_null_driver()``
 * makes every later launch succeed without a driver (tools/profile_host.py --stub times
 * the packing that way).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <limits.h>
#include <stddef.h>
#include <string.h>

/* cuda.h: typedef enum cudaError_enum {...} CUresult; 0 is CUDA_SUCCESS. */
typedef int CUresult;
/* cuda.h: typedef struct CUfunc_st *CUfunction; typedef struct CUstream_st *CUstream; */
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
/* cuda.h: typedef enum CUlaunchAttributeID_enum {...} CUlaunchAttributeID; */
typedef int CUlaunchAttributeID;
/* cuda.h, CUlaunchAttributeID_enum: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6 */
#define CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION 6

/* cuda.h: union CUlaunchAttributeValue_union, padded to 64 bytes (other members left out). */
typedef union {
  char pad[64];
  int programmaticStreamSerializationAllowed;
} CUlaunchAttributeValue;

/* cuda.h: struct CUlaunchAttribute_st. */
typedef struct {
  CUlaunchAttributeID id;
  char pad[8 - sizeof(CUlaunchAttributeID)];
  CUlaunchAttributeValue value;
} CUlaunchAttribute;

/* cuda.h: struct CUlaunchConfig_st. */
typedef struct {
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute *attrs;
  unsigned int numAttrs;
} CUlaunchConfig;

/* cuda.h: cuLaunchKernel and cuLaunchKernelEx (the exported, non-_ptsz entry points). */
typedef CUresult (*LaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int,
                                 unsigned int, unsigned int, unsigned int, unsigned int,
                                 CUstream, void **, void **);
typedef CUresult (*LaunchKernelEx)(const CUlaunchConfig *, CUfunction, void **, void **);

/* Set once under the GIL by open_driver; cu_launch last, as the mark that both are set. */
static LaunchKernelEx cu_launch_ex;
static LaunchKernel cu_launch;

/* The driver library, or NULL with a RuntimeError set. */
static void *libcuda(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    const char *why = dlerror();
    PyErr_Format(PyExc_RuntimeError, "the CUDA driver (libcuda.so.1) cannot be loaded: %s",
                 why ? why : "unknown error");
  }
  return lib;
}

static int open_driver(void) {
  void *lib = libcuda();
  if (lib == NULL) {
    return -1;
  }
  LaunchKernel launch = (LaunchKernel)dlsym(lib, "cuLaunchKernel");
  LaunchKernelEx launch_ex = (LaunchKernelEx)dlsym(lib, "cuLaunchKernelEx");
  if (launch == NULL || launch_ex == NULL) {
    PyErr_SetString(PyExc_RuntimeError,
                    "libcuda.so.1 lacks cuLaunchKernel or cuLaunchKernelEx (a driver "
                    "older than CUDA 11.8)");
    return -1; /* the library stays open: the process loaded it anyway */
  }
  cu_launch_ex = launch_ex;
  cu_launch = launch;
  return 0;
}

/* The null driver (use_null_driver): launches that do nothing and succeed. */
static CUresult null_launch(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                            unsigned int bx, unsigned int by, unsigned int bz, unsigned int smem,
                            CUstream stream, void **params, void **extra) {
  return 0;
}

static CUresult null_launch_ex(const CUlaunchConfig *config, CUfunction f, void **params,
                               void **extra) {
  return 0;
}

static PyObject *use_null_driver(PyObject *module, PyObject *unused) {
  cu_launch_ex = null_launch_ex;
  cu_launch = null_launch;
  Py_RETURN_NONE;
}

typedef struct {
  CUfunction function;
  unsigned int dims[7]; /* grid x, y, z, block x, y, z, dynamic shared memory bytes */
  CUstream stream;
  void **params;
} Launch;

static int parse(PyObject *const *args, Py_ssize_t nargs, Launch *out) {
  if (nargs != 10) {
    PyErr_Format(PyExc_TypeError,
                 "takes 10 arguments (function, gx, gy, gz, bx, by, bz, smem, stream, "
                 "params), got %zd",
                 nargs);
    return -1;
  }
  if (cu_launch == NULL && open_driver() < 0) {
    return -1;
  }
  out->function = (CUfunction)PyLong_AsVoidPtr(args[0]);
  for (int i = 0; i < 7; ++i) {
    unsigned long value = PyLong_AsUnsignedLong(args[1 + i]);
    if (value == (unsigned long)-1 && PyErr_Occurred()) {
      return -1;
    }
    if (value > UINT_MAX) {
      PyErr_SetString(PyExc_OverflowError, "a grid, block or shared memory size exceeds 32 bits");
      return -1;
    }
    out->dims[i] = (unsigned int)value;
  }
  out->stream = (CUstream)PyLong_AsVoidPtr(args[8]);
  out->params = (void **)PyLong_AsVoidPtr(args[9]);
  return PyErr_Occurred() ? -1 : 0; /* PyLong_AsVoidPtr: NULL is also a valid stream */
}

static PyObject *launch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
  Launch l;
  if (parse(args, nargs, &l) < 0) {
    return NULL;
  }
  CUresult err;
  /* The GIL is released as cuda-python does: a launch can block on a full launch queue. */
  Py_BEGIN_ALLOW_THREADS
  err = cu_launch(l.function, l.dims[0], l.dims[1], l.dims[2], l.dims[3], l.dims[4],
                  l.dims[5], l.dims[6], l.stream, l.params, NULL);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(err);
}

static PyObject *launch_programmatic(PyObject *module, PyObject *const *args,
                                     Py_ssize_t nargs) {
  Launch l;
  if (parse(args, nargs, &l) < 0) {
    return NULL;
  }
  CUlaunchAttribute attribute;
  memset(&attribute, 0, sizeof attribute);
  attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attribute.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config = {l.dims[0], l.dims[1], l.dims[2], l.dims[3], l.dims[4],
                           l.dims[5], l.dims[6], l.stream, &attribute, 1};
  CUresult err;
  Py_BEGIN_ALLOW_THREADS
  err = cu_launch_ex(&config, l.function, l.params, NULL);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(err);
}

#include "_launcher_bound.h" /* Bound */
#include "_launcher_driver.h" /* load_library, occupancy, attributes */

/* The declared types' layout, for the test against cuda.h. */
static PyObject *layout(PyObject *module, PyObject *unused) {
  return Py_BuildValue(
      "{s:n,s:n,s:n,s:n,s:n,s:n,s:i}", "CUlaunchConfig", (Py_ssize_t)sizeof(CUlaunchConfig),
      "CUlaunchConfig.hStream", (Py_ssize_t)offsetof(CUlaunchConfig, hStream),
      "CUlaunchConfig.attrs", (Py_ssize_t)offsetof(CUlaunchConfig, attrs),
      "CUlaunchConfig.numAttrs", (Py_ssize_t)offsetof(CUlaunchConfig, numAttrs),
      "CUlaunchAttribute", (Py_ssize_t)sizeof(CUlaunchAttribute), "CUlaunchAttribute.value",
      (Py_ssize_t)offsetof(CUlaunchAttribute, value),
      "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION",
      CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(function, gx, gy, gz, bx, by, bz, smem, stream, params) -> CUresult"},
    {"launch_programmatic", (PyCFunction)(void (*)(void))launch_programmatic, METH_FASTCALL,
     "launch_programmatic(<launch's arguments>) -> CUresult of cuLaunchKernelEx with "
     "programmatic stream serialization"},
    {"use_null_driver", use_null_driver, METH_NOARGS,
     "later launches succeed without calling the driver (host-time stubs)"},
    {"layout", layout, METH_NOARGS, "the declared driver types' sizes and offsets"},
    DRIVER_METHODS
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_launcher", "flashinfer-jit's kernel launcher", -1, methods,
};

PyMODINIT_FUNC PyInit__launcher(void) {
  if (PyType_Ready(&BoundType) < 0) {
    return NULL;
  }
  PyObject *module = PyModule_Create(&module_def);
  if (module == NULL) {
    return NULL;
  }
  Py_INCREF(&BoundType);
  if (PyModule_AddObject(module, "Bound", (PyObject *)&BoundType) < 0) {
    Py_DECREF(&BoundType);
    Py_DECREF(module);
    return NULL;
  }
  return module;
}
