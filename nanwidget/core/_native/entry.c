/* The kernels of absrange.c as a CPython extension module: one call per tensor from the hooks.
 *
 * ctypes costs about a microsecond per call (argument conversion, libffi) before the kernel
 * runs, and the checks that make a tensor safe to hand over (type, device, dtype, size,
 * contiguity, storage) cost as much again as Python bytecode. Here both are one C function:
 * the same checks, in the same order, through the tensor's own Python attributes (no torch
 * headers: nothing here depends on torch's C++ layout), then the kernel. The storage is checked
 * to hold the elements (a tensor whose storage was shrunk under it is declined, never read).
 *
 * gradient_range(tensor[, out]) is contiguous_range without the storage check, for a gradient
 * handed to a tensor hook (nanwidget.core.native.gradient_range): autograd reads it right after
 * the hook anyway, and asking for its storage (`untyped_storage()`) leaves a Python storage
 * object on it that counts as an owner, so autograd would sum the tensor's next gradient out of
 * place (another memory layout, other bits in the ops after it).
 *
 * contiguous_range(tensor[, out]) and int_range(tensor[, out]) return what
 * nanwidget.core.native.contiguous_range / int_range return: (low, high) as floats, or None for
 * a tensor they do not take; an exception raised by one of the tensor's attributes propagates
 * as it would there. `out` is accepted and ignored (same signature as the ctypes path).
 * setup() is called once by native.py with the types, the dtype -> kind maps and the size limit.
 *
 * grads_clean(containers, keys, indices) is the sentinel's check of every parameter's gradient at
 * the end of a backward pass (nanwidget.core.native.grads_clean's loop over the parameters
 * containers[i].get(keys[i]), with contiguous_range's checks and read per gradient) in one call.
 *
 * weight_state(containers, keys, modules) reads what a held batch keeps of the weights in one
 * call (nanwidget.core.replay.capture.BatchCapture.on_batch_start): a 4-tuple of lists, the
 * tensors (containers[i][keys[i]]), their version counters (`_version`), their layouts
 * ((data_ptr(), dtype) tuples) and the modules' `training` flags, read through the same Python
 * attributes as the Python path. It returns None, for the Python path to read (and raise)
 * as it does, whenever anything is unusual: a container that is not exactly a dict, a slot
 * missing or not exactly a Tensor or Parameter, an attribute that raises.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "absrange.c"

typedef int (*nw_kernel)(const void *, int64_t, int64_t, double *);

static PyObject *tensor_type, *parameter_type, *float_kinds, *int_kinds;
static PyObject *name_version, *name_training, *name_grad;
static PyObject *name_is_cpu, *name_dtype, *name_numel, *name_is_contiguous, *name_data_ptr,
    *name_storage_offset, *name_untyped_storage, *name_nbytes, *name_element_size;
static long long max_elements;

/* Above this many elements the read takes long enough to let other Python threads run. */
#define NW_RELEASE_GIL_ELEMENTS (1 << 16)

/* Call a method that returns an int; -1 with an exception set on failure. */
static long long int_method(PyObject *object, PyObject *name) {
    PyObject *value = PyObject_CallMethodNoArgs(object, name);
    if (value == NULL)
        return -1;
    long long result = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return result;
}

/* 1 when the tensor's storage holds its `count` elements from its offset, 0 when it does not
 * (shrunk under it), -1 with an exception set (native.storage_holds, for a dense tensor). */
static int storage_holds(PyObject *tensor, long long count) {
    long long offset = int_method(tensor, name_storage_offset);
    if (offset == -1 && PyErr_Occurred())
        return -1;
    long long size = int_method(tensor, name_element_size);
    if (size == -1 && PyErr_Occurred())
        return -1;
    PyObject *storage = PyObject_CallMethodNoArgs(tensor, name_untyped_storage);
    if (storage == NULL)
        return -1;
    long long nbytes = int_method(storage, name_nbytes);
    Py_DECREF(storage);
    if (nbytes == -1 && PyErr_Occurred())
        return -1;
    return (offset + count) * size <= nbytes;
}

/* Check `tensor` as the readers do and read it with `kernel` into out: 1 when read, 0 when it
 * is not a tensor they take (or the kernel declined it), -1 with an exception set when one of
 * its attributes raised. `check_storage` 0: the storage is not asked (gradient_range). */
static int read_checked(PyObject *tensor, PyObject *kinds, nw_kernel kernel, double *out,
                        int check_storage) {
    PyObject *type = (PyObject *)Py_TYPE(tensor);
    if (tensor_type == NULL || (type != tensor_type && type != parameter_type))
        return 0;
    PyObject *value = PyObject_GetAttr(tensor, name_is_cpu);
    if (value == NULL)
        return -1;
    int on_cpu = value == Py_True;
    Py_DECREF(value);
    if (!on_cpu)
        return 0;
    value = PyObject_GetAttr(tensor, name_dtype);
    if (value == NULL)
        return -1;
    PyObject *kind_object = PyDict_GetItemWithError(kinds, value); /* borrowed */
    Py_DECREF(value);
    if (kind_object == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long kind = PyLong_AsLong(kind_object);
    if (kind == -1 && PyErr_Occurred())
        return -1;
    value = PyObject_CallMethodNoArgs(tensor, name_numel);
    if (value == NULL)
        return -1;
    long long count = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (count == -1 && PyErr_Occurred())
        return -1;
    if (count <= 0 || count > max_elements)
        return 0;
    value = PyObject_CallMethodNoArgs(tensor, name_is_contiguous);
    if (value == NULL)
        return -1;
    int contiguous = value == Py_True;
    Py_DECREF(value);
    if (!contiguous)
        return 0;
    value = PyObject_CallMethodNoArgs(tensor, name_data_ptr);
    if (value == NULL)
        return -1;
    void *data = PyLong_AsVoidPtr(value);
    Py_DECREF(value);
    if (data == NULL)
        return PyErr_Occurred() ? -1 : 0; /* storage freed (FSDP between forwards) */
    /* The storage must hold every element: one shrunk under the tensor (resize_) would be read
     * past its end. */
    if (check_storage) {
        int holds = storage_holds(tensor, count);
        if (holds <= 0)
            return holds;
    }
    int status;
    if (count >= NW_RELEASE_GIL_ELEMENTS) {
        Py_BEGIN_ALLOW_THREADS
        status = kernel(data, count, kind, out);
        Py_END_ALLOW_THREADS
    } else {
        status = kernel(data, count, kind, out);
    }
    return status == 0;
}

static PyObject *read_with(PyObject *tensor, PyObject *kinds, nw_kernel kernel,
                           int check_storage) {
    double out[2];
    int found = read_checked(tensor, kinds, kernel, out, check_storage);
    if (found < 0)
        return NULL;
    if (!found)
        Py_RETURN_NONE;
    return Py_BuildValue("(dd)", out[0], out[1]);
}

static PyObject *contiguous_range(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "contiguous_range(tensor, out=None)");
        return NULL;
    }
    return read_with(args[0], float_kinds, nanwidget_abs_range, 1);
}

static PyObject *gradient_range(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "gradient_range(tensor, out=None)");
        return NULL;
    }
    return read_with(args[0], float_kinds, nanwidget_abs_range, 0);
}

static PyObject *int_range(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "int_range(tensor, out=None)");
        return NULL;
    }
    return read_with(args[0], int_kinds, nanwidget_int_range, 1);
}

/* The arguments of grads_clean and weight_state: three lists, the first two (the slots'
 * containers and keys) as long as each other. 1 when they are; 0 when not (the caller returns
 * None, for its Python path to decide); -1 with a TypeError when there are not three. */
static int slot_lists(PyObject *const *args, Py_ssize_t nargs, const char *usage) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    return tensor_type != NULL && PyList_CheckExact(args[0]) && PyList_CheckExact(args[1])
        && PyList_CheckExact(args[2]) && PyList_GET_SIZE(args[1]) == PyList_GET_SIZE(args[0]);
}

/* grads_clean(containers, keys, indices): the sentinel's gradient check in one call. For each
 * i of `indices` whose parameter containers[i].get(keys[i]) is not None and whose `.grad` is
 * not None: False as soon as that gradient is not a tensor contiguous_range reads (it would
 * return None) or its abs max is not below +inf (NaN or Inf); True when every one was read and
 * finite (nanwidget.core.native.grads_clean on the parameters). Exceptions raised by an
 * attribute propagate, from the same gradient as in the Python loop. None (nothing read) when
 * an argument is not exactly a list, the lists' lengths differ, an index is not a plain int
 * within them or a container it names is not exactly a dict: the caller's Python path then
 * does (and raises) what it does. */
static PyObject *grads_clean(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    int usable = slot_lists(args, nargs, "grads_clean(containers, keys, indices)");
    if (usable < 0)
        return NULL;
    if (!usable)
        Py_RETURN_NONE;
    PyObject *containers = args[0], *keys = args[1], *indices = args[2];
    Py_ssize_t size = PyList_GET_SIZE(containers), count = PyList_GET_SIZE(indices);
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *index = PyList_GET_ITEM(indices, j);
        if (!PyLong_CheckExact(index))
            Py_RETURN_NONE;
        Py_ssize_t i = PyLong_AsSsize_t(index);
        if (i == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (i < 0 || i >= size || !PyDict_CheckExact(PyList_GET_ITEM(containers, i)))
            Py_RETURN_NONE;
    }
    /* The lists are the caller's own and not changed while this runs; a .grad property could
     * run Python code, so they are checked again all the same. */
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(indices); j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(indices, j));
        if (i < 0 || i >= PyList_GET_SIZE(containers) || PyList_GET_SIZE(keys) <= i)
            Py_RETURN_NONE;
        PyObject *container = PyList_GET_ITEM(containers, i);
        if (!PyDict_CheckExact(container))
            Py_RETURN_NONE;
        PyObject *param = PyDict_GetItemWithError(container, PyList_GET_ITEM(keys, i));
        if (param == NULL) {
            if (PyErr_Occurred())
                return NULL; /* as dict.get raises */
            continue;        /* missing: dict.get's None */
        }
        if (param == Py_None)
            continue;
        Py_INCREF(param);
        PyObject *grad = PyObject_GetAttr(param, name_grad);
        Py_DECREF(param);
        if (grad == NULL)
            return NULL;
        if (grad == Py_None) {
            Py_DECREF(grad);
            continue;
        }
        double out[2];
        int found = read_checked(grad, float_kinds, nanwidget_abs_range, out, 1);
        Py_DECREF(grad);
        if (found < 0)
            return NULL;
        if (!found || !(out[1] < INFINITY))
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *weight_state(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    int usable = slot_lists(args, nargs, "weight_state(containers, keys, modules)");
    if (usable < 0)
        return NULL;
    if (!usable)
        Py_RETURN_NONE;
    PyObject *containers = args[0], *keys = args[1], *modules = args[2];
    Py_ssize_t count = PyList_GET_SIZE(containers), module_count = PyList_GET_SIZE(modules);
    PyObject *weights = PyList_New(count), *versions = PyList_New(count);
    PyObject *layout = PyList_New(count), *training = PyList_New(module_count);
    PyObject *result = NULL;
    if (weights == NULL || versions == NULL || layout == NULL || training == NULL)
        goto done; /* out of memory: raised, as the Python path would */
    for (Py_ssize_t i = 0; i < module_count; i++) {
        PyObject *flag = PyObject_GetAttr(PyList_GET_ITEM(modules, i), name_training);
        if (flag == NULL)
            goto decline;
        PyList_SET_ITEM(training, i, flag);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *container = PyList_GET_ITEM(containers, i);
        if (!PyDict_CheckExact(container))
            goto decline;
        PyObject *tensor = PyDict_GetItemWithError(container, PyList_GET_ITEM(keys, i));
        if (tensor == NULL) /* missing (or an error): the Python path decides */
            goto decline;
        PyObject *type = (PyObject *)Py_TYPE(tensor);
        if (type != tensor_type && type != parameter_type)
            goto decline; /* None, or a subclass */
        Py_INCREF(tensor);
        PyList_SET_ITEM(weights, i, tensor);
        PyObject *version = PyObject_GetAttr(tensor, name_version);
        if (version == NULL)
            goto decline; /* an inference tensor: no version counter */
        PyList_SET_ITEM(versions, i, version);
        PyObject *pointer = PyObject_CallMethodNoArgs(tensor, name_data_ptr);
        if (pointer == NULL)
            goto decline;
        PyObject *dtype = PyObject_GetAttr(tensor, name_dtype);
        if (dtype == NULL) {
            Py_DECREF(pointer);
            goto decline;
        }
        PyObject *pair = PyTuple_New(2);
        if (pair == NULL) {
            Py_DECREF(pointer);
            Py_DECREF(dtype);
            goto done;
        }
        PyTuple_SET_ITEM(pair, 0, pointer);
        PyTuple_SET_ITEM(pair, 1, dtype);
        PyList_SET_ITEM(layout, i, pair);
    }
    result = PyTuple_Pack(4, weights, versions, layout, training);
    goto done;
decline:
    PyErr_Clear();
    Py_INCREF(Py_None);
    result = Py_None;
done:
    Py_XDECREF(weights);
    Py_XDECREF(versions);
    Py_XDECREF(layout);
    Py_XDECREF(training);
    return result;
}

static PyObject *setup(PyObject *module, PyObject *args) {
    PyObject *tensor, *parameter, *floats, *ints;
    long long limit;
    if (!PyArg_ParseTuple(args, "OOO!O!L", &tensor, &parameter, &PyDict_Type, &floats,
                          &PyDict_Type, &ints, &limit))
        return NULL;
    if (name_is_cpu == NULL) {
        name_is_cpu = PyUnicode_InternFromString("is_cpu");
        name_dtype = PyUnicode_InternFromString("dtype");
        name_numel = PyUnicode_InternFromString("numel");
        name_is_contiguous = PyUnicode_InternFromString("is_contiguous");
        name_data_ptr = PyUnicode_InternFromString("data_ptr");
        name_storage_offset = PyUnicode_InternFromString("storage_offset");
        name_untyped_storage = PyUnicode_InternFromString("untyped_storage");
        name_nbytes = PyUnicode_InternFromString("nbytes");
        name_element_size = PyUnicode_InternFromString("element_size");
        name_version = PyUnicode_InternFromString("_version");
        name_training = PyUnicode_InternFromString("training");
        name_grad = PyUnicode_InternFromString("grad");
        if (!name_is_cpu || !name_dtype || !name_numel || !name_is_contiguous || !name_data_ptr
            || !name_storage_offset || !name_untyped_storage || !name_nbytes || !name_element_size
            || !name_version || !name_training || !name_grad)
            return NULL;
    }
    Py_INCREF(tensor);
    Py_INCREF(parameter);
    Py_INCREF(floats);
    Py_INCREF(ints);
    Py_XSETREF(tensor_type, tensor);
    Py_XSETREF(parameter_type, parameter);
    Py_XSETREF(float_kinds, floats);
    Py_XSETREF(int_kinds, ints);
    max_elements = limit;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"contiguous_range", (PyCFunction)(void (*)(void))contiguous_range, METH_FASTCALL, NULL},
    {"gradient_range", (PyCFunction)(void (*)(void))gradient_range, METH_FASTCALL, NULL},
    {"int_range", (PyCFunction)(void (*)(void))int_range, METH_FASTCALL, NULL},
    {"weight_state", (PyCFunction)(void (*)(void))weight_state, METH_FASTCALL, NULL},
    {"grads_clean", (PyCFunction)(void (*)(void))grads_clean, METH_FASTCALL, NULL},
    {"setup", setup, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {PyModuleDef_HEAD_INIT, "_nanwidget_entry", NULL, -1,
                                        methods};

PyMODINIT_FUNC PyInit__nanwidget_entry(void) { return PyModule_Create(&definition); }
