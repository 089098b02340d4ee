//! The emulator is loaded as `libcuda.so.1`: give it that soname, so `dlopen("libcuda.so.1",
//! RTLD_NOLOAD)` (the preload shim's check for an already-loaded driver) finds it.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
