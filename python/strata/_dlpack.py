"""DLPack export (the legacy, unversioned `DLManagedTensor` in a "dltensor" capsule) over ctypes.

`capsule(...)` describes memory strata owns (a KV tensor) to a framework without a copy:
`torch.from_dlpack(obj)` calls `obj.__dlpack__()`, which returns such a capsule. The
DLManagedTensor, its shape and strides arrays and a reference to the owner stay alive in `_live`
until the consumer calls the deleter (when its tensor is freed), or until the capsule is garbage
collected unconsumed.
"""

import ctypes
import threading

# DLDeviceType
CPU = 1
CUDA = 2

# DLDataTypeCode
_INT, _UINT, _FLOAT, _BFLOAT = 0, 1, 2, 4

DTYPES = {
    "float16": (_FLOAT, 16),
    "bfloat16": (_BFLOAT, 16),
    "float32": (_FLOAT, 32),
    "float64": (_FLOAT, 64),
    "int8": (_INT, 8),
    "uint8": (_UINT, 8),
    "int16": (_INT, 16),
    "int32": (_INT, 32),
    "int64": (_INT, 64),
}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_lock = threading.Lock()
# address of a DLManagedTensor -> (the struct, shape array, strides array, owner)
_live = {}


def _release(address):
    with _lock:
        entry = _live.pop(address, None)
    if entry is not None:
        entry[3]._dlpack_released()


@_Deleter
def _deleter(managed):
    _release(ctypes.cast(managed, ctypes.c_void_p).value)


_NAME = b"dltensor"
_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule):
    # A consumer renames the capsule ("used_dltensor") and owns the tensor from then on; a
    # capsule still named "dltensor" was never consumed: release its tensor here.
    if _api.PyCapsule_IsValid(capsule, _NAME):
        _release(_api.PyCapsule_GetPointer(capsule, _NAME))


def dtype_of(dtype, elem_size):
    """(code, bits) of a dtype name ("float16", "torch.bfloat16", ...) of `elem_size` bytes."""
    name = str(dtype).rsplit(".", 1)[-1]
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    code, bits = DTYPES[name]
    if bits // 8 != elem_size:
        raise ValueError(f"dtype {name} has {bits // 8} bytes per element, the space {elem_size}")
    return code, bits


def capsule(owner, data, device_type, device_id, dtype, shape, strides):
    """A "dltensor" capsule for `data` (an address) with `shape` and element `strides`. The
    owner is kept alive until the consumer releases the tensor and is told through
    `owner._dlpack_released()`."""
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * ndim)(*shape)
    strides_arr = (ctypes.c_int64 * ndim)(*strides)
    managed = DLManagedTensor()
    managed.dl_tensor.data = data
    managed.dl_tensor.device = DLDevice(device_type, device_id)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = DLDataType(dtype[0], dtype[1], 1)
    managed.dl_tensor.shape = shape_arr
    managed.dl_tensor.strides = strides_arr
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    with _lock:
        _live[address] = (managed, shape_arr, strides_arr, owner)
    try:
        return _api.PyCapsule_New(address, _NAME, ctypes.cast(_capsule_destructor, ctypes.c_void_p))
    except BaseException:
        _release(address)
        raise
