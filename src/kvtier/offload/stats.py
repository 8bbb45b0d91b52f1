"""What an offloaded request cost the device and the host link (reported per request and by the engine)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class OffloadStats:
    """One offloaded request: what its long context cost the device and the host link."""

    mode: str = ""
    peak_device_kv_bytes: int = 0   # its device window (blocks in the arena) at its largest
    host_kv_bytes: int = 0          # its KV in host memory now (at the end: at its largest)
    summary_bytes: int = 0          # its block summaries on the device (sparse)
    fetched_bytes: int = 0          # host -> device, all steps
    fetch_seconds: float = 0.0      # waiting for fetches on the step thread (not hidden by compute; on CUDA
                                    # the host's wait for copies to be issued, not the device's for them)
    num_decode_tokens: int = 0
    decode_fetched_bytes: int = 0   # fetched by decode steps (for bytes per decode token)

    @property
    def fetched_bytes_per_token(self) -> float:
        return self.decode_fetched_bytes / self.num_decode_tokens if self.num_decode_tokens else 0.0

    def to_dict(self) -> dict:
        return {"mode": self.mode, "peak_device_kv_bytes": self.peak_device_kv_bytes,
                "host_kv_bytes": self.host_kv_bytes, "summary_bytes": self.summary_bytes,
                "fetched_bytes": self.fetched_bytes, "fetched_bytes_per_decode_token": self.fetched_bytes_per_token,
                "fetch_seconds": self.fetch_seconds}
