use super::*;

/// Queues `f` on `stream` with a one-dimensional grid and block and no dynamic shared
/// memory. `params` holds one pointer per kernel parameter, each to a value of exactly the
/// parameter's type; the driver copies the values before returning.
///
/// # Safety
///
/// 1. `f` is a function of a live module of the current context.
/// 2. `params` matches the kernel's parameter list in number, order and types.
/// 3. Every memory the kernel touches with these parameters is valid for it (device VA
///    mapped with access for this device, or pinned host memory) until the launch completes.
/// 4. `stream` is null or live, in the current context.
pub unsafe fn kernel(
    f: CUfunction,
    grid: u32,
    block: u32,
    params: &mut [*mut c_void],
    stream: CUstream,
) -> Result<()> {
    // SAFETY: the caller guarantees the function, the parameters and the memory they reach;
    // `params` outlives the call; `extra` is null (parameters come from `params`).
    call("cuLaunchKernel", || unsafe {
        sys::cuLaunchKernel(
            f,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}
