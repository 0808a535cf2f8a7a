//! Finding the CUDA driver. kvrs loads libcuda at run time (cudarc's dynamic loading), so
//! it builds and runs on machines without a GPU or CUDA toolkit; this module tells
//! whether a driver and devices are there without touching the driver when it is absent
//! (cudarc panics on a missing libcuda).

/// The number of CUDA devices, or why there are none usable.
pub fn device_count() -> Result<usize, String> {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only tries to open the library; nothing is called from it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(
                "no CUDA driver found (libcuda.so could not be loaded); install the NVIDIA driver"
                    .into(),
            );
        }
        cudarc::driver::result::init()
            .map_err(|e| format!("the CUDA driver failed to initialise: {e}"))?;
        let n = cudarc::driver::result::device::get_count()
            .map_err(|e| format!("cannot count CUDA devices: {e}"))?;
        Ok(n.max(0) as usize)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this build of kvrs has no CUDA support (built without the 'cuda' feature)".into())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reports_instead_of_panicking() {
        // On a machine without a driver this is an error message; with one, a count.
        match super::device_count() {
            Ok(n) => assert!(n < 1024),
            Err(why) => assert!(why.contains("CUDA"), "{why}"),
        }
    }
}
