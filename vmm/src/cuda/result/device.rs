use super::*;

/// Number of CUDA devices (after [`init`]).
pub fn count() -> Result<i32> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer for the call.
    call("cuDeviceGetCount", || unsafe {
        sys::cuDeviceGetCount(&mut n)
    })?;
    Ok(n)
}

/// The device handle of ordinal `ordinal`.
pub fn get(ordinal: i32) -> Result<CUdevice> {
    let mut dev: CUdevice = 0;
    // SAFETY: `dev` is a valid out-pointer; an out-of-range ordinal is reported as an error.
    call("cuDeviceGet", || unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    Ok(dev)
}

/// The device's marketing name.
pub fn name(dev: CUdevice) -> Result<String> {
    let mut buf = [0 as c_char; 256];
    let len = buf.len() as c_int;
    // SAFETY: `buf` is writable for `len` bytes; the driver writes at most `len` bytes,
    // NUL-terminated.
    call("cuDeviceGetName", || unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), len, dev)
    })?;
    // Force termination in case the driver filled the buffer exactly.
    buf[buf.len() - 1] = 0;
    // SAFETY: `buf` is NUL-terminated (forced above) and lives across the borrow.
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Ok(name.to_string_lossy().into_owned())
}

/// One integer attribute of the device (compute capability, grid limits, ...).
pub fn attribute(dev: CUdevice, attribute: sys::CUdevice_attribute) -> Result<i32> {
    let mut value: c_int = 0;
    // SAFETY: `value` is a valid out-pointer; the driver validates `dev` and `attribute`.
    call("cuDeviceGetAttribute", || unsafe {
        sys::cuDeviceGetAttribute(&mut value, attribute, dev)
    })?;
    Ok(value)
}

/// Total device memory in bytes.
pub fn total_mem(dev: CUdevice) -> Result<u64> {
    let mut bytes: usize = 0;
    // SAFETY: `bytes` is a valid out-pointer for the call.
    call("cuDeviceTotalMem_v2", || unsafe {
        sys::cuDeviceTotalMem_v2(&mut bytes, dev)
    })?;
    Ok(bytes as u64)
}
