//! Element types a device buffer can hold, and their conversion to the f32 the math runs in.

use half::bf16;

/// The storage types the op set understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    I32,
    /// Raw bytes (KV blocks and state slots).
    U8,
}

impl DType {
    /// Suffix of the CUDA entry points specialised for this type (`di_rms_norm_vec_bf16`, ...).
    pub fn kernel_suffix(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U8 => "u8",
        }
    }
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 => 2,
            DType::U8 => 1,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for i32 {}
    impl Sealed for u8 {}
}

#[cfg(feature = "cuda")]
pub trait DeviceStorable: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
#[cfg(feature = "cuda")]
impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> DeviceStorable for T {}
#[cfg(not(feature = "cuda"))]
pub trait DeviceStorable {}
#[cfg(not(feature = "cuda"))]
impl<T> DeviceStorable for T {}

/// A value a [`crate::DeviceBuffer`] can hold. Math is done in f32; `from_f32` rounds to nearest even.
pub trait Element: sealed::Sealed + bytemuck::Pod + DeviceStorable + Send + Sync + std::fmt::Debug + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Element for i32 {
    const DTYPE: DType = DType::I32;
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(v: f32) -> Self {
        v as i32
    }
}

impl Element for u8 {
    const DTYPE: DType = DType::U8;
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn from_f32(v: f32) -> Self {
        v as u8
    }
}
