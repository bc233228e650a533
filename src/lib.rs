pub mod csi;
