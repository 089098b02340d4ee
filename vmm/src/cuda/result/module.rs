use super::*;

/// Loads a module into the current context from an image in memory.
///
/// # Safety
///
/// 1. `image` is a complete cubin, or PTX text ending in NUL (as NVRTC produced it): the
///    driver parses it without a length.
/// 2. A context is current; the module belongs to it and is unloaded with that context
///    current ([`unload`]).
pub unsafe fn load_data(image: &[u8]) -> Result<CUmodule> {
    let mut module: CUmodule = std::ptr::null_mut();
    // SAFETY: `module` is a valid out-pointer; the caller guarantees the image is complete.
    call("cuModuleLoadData", || unsafe {
        sys::cuModuleLoadData(&mut module, image.as_ptr().cast::<c_void>())
    })?;
    Ok(module)
}

/// Unloads a module.
///
/// # Safety
///
/// 1. `module` came from [`load_data`], is unloaded once with its context current, and no
///    launch of its functions is still queued or running.
pub unsafe fn unload(module: CUmodule) -> Result<()> {
    // SAFETY: the caller guarantees the module is live, idle and unloaded once.
    call("cuModuleUnload", || unsafe { sys::cuModuleUnload(module) })
}

/// The entry point `name` of a loaded module.
///
/// # Safety
///
/// 1. `module` is live (loaded and not unloaded).
pub unsafe fn function(module: CUmodule, name: &CStr) -> Result<CUfunction> {
    let mut f: CUfunction = std::ptr::null_mut();
    // SAFETY: `f` is a valid out-pointer, `name` a NUL-terminated string that outlives the
    // call; the caller guarantees the module.
    call("cuModuleGetFunction", || unsafe {
        sys::cuModuleGetFunction(&mut f, module, name.as_ptr())
    })?;
    Ok(f)
}
