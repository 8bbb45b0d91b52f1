"""Links that KV crosses between a GPU and memory outside it: host DRAM over PCIe, a CXL memory expander,
a pooled store over RDMA.

Bandwidths are nominal per-direction line rates of one x16 link (or one NIC) per GPU: lanes x transfer rate,
before encoding overhead (PCIe 3.0-5.0 and CXL 1.x-2.0 use 128b/130b, ~1.5%; PCIe 6.0 and CXL 3.x use
FLITs, ~6%). Measured copies reach less: pinned-memory cudaMemcpy over PCIe 5.0 x16 is ~50-55 GB/s. GPUs
that share a link (one CXL expander or one NIC for two GPUs, a PCIe switch with one uplink) divide it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostLink:
    name: str
    bytes_s: float  # one direction, per GPU
    memory: str     # where the off-device KV lives when this link carries it


LINKS: dict[str, HostLink] = {link.name: link for link in [
    # PCI-SIG base specs: 4.0 = 16 GT/s, 5.0 = 32 GT/s, 6.0 = 64 GT/s (PAM4) per lane; x 16 lanes / 8 bits.
    HostLink("pcie4-x16", 32e9, "host DRAM"),
    HostLink("pcie5-x16", 64e9, "host DRAM"),
    HostLink("pcie6-x16", 128e9, "host DRAM"),
    # CXL Consortium: CXL 2.0 runs on the PCIe 5.0 PHY, CXL 3.x on the PCIe 6.0 PHY (Type 3 memory expander, x16).
    HostLink("cxl2-x16", 64e9, "CXL expander"),
    HostLink("cxl3-x16", 128e9, "CXL expander"),
    # InfiniBand HDR / 200GbE and NDR / 400GbE RoCE: one NIC per GPU (as on DGX H100), a pool such as Mooncake Store.
    HostLink("rdma-200g", 200e9 / 8, "memory pool"),
    HostLink("rdma-400g", 400e9 / 8, "memory pool"),
]}

