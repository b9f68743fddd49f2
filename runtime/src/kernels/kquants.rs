//! The GGUF K-quants' super-blocks of 256 weights, as the file holds them: what the panels
//! ([`super::kpanels`]) repack when a model loads.

/// Weights per super-block.
pub(crate) const QK_K: usize = 256;

/// The GGUF layouts (ggml's `block_q4_K`, `block_q5_K`, `block_q6_K`).
pub(crate) mod layout {
    /// w = d · sc_j · q − dmin · m_j over sub-blocks j of 32; 6-bit sc and m packed in `scales`.
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q4K {
        pub d: u16,
        pub dmin: u16,
        pub scales: [u8; 12],
        pub qs: [u8; 128],
    }
    /// Q4_K's with a fifth bit per quant: bit 2i (2i + 1) of `qh[l]` is the high bit of the
    /// low (high) nibble of `qs[32i + l]`.
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q5K {
        pub d: u16,
        pub dmin: u16,
        pub scales: [u8; 12],
        pub qh: [u8; 32],
        pub qs: [u8; 128],
    }
    /// w = d · sc_j · (q − 32) over sub-blocks j of 16; q's low 4 bits in `ql`, high 2 in `qh`.
    #[derive(Debug, Clone, Copy)]
    #[repr(C)]
    pub(crate) struct Q6K {
        pub ql: [u8; 128],
        pub qh: [u8; 64],
        pub scales: [i8; 16],
        pub d: u16,
    }
    const _: () = assert!(std::mem::size_of::<Q4K>() == 144);
    const _: () = assert!(std::mem::size_of::<Q5K>() == 176);
    const _: () = assert!(std::mem::size_of::<Q6K>() == 210);
}
