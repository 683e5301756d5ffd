"""TRL's ``WeightTransferProtocol`` on the xccl_rs engine."""

from __future__ import annotations

from typing import Optional

from ..weight_sync import DEFAULT_BUCKET_BYTES


class TRLWeightTransfer:
    """TRL's ``WeightTransferProtocol`` on this engine: pass it as ``weight_transfer=`` to TRL's
    experimental ``AsyncGRPOTrainer`` or ``AsyncDistillationTrainer`` (TRL 1.16), whose own
    default is vLLM's NCCL engine.

    ``vllm_client`` is TRL's ``trl.experimental.async_grpo.vllm_client.VLLMClient`` (its
    ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and
    ``finish_weight_update`` are vLLM's weight-sync calls over HTTP), for a server started with
    ``VLLM_SERVER_DEV_MODE=1 vllm serve ... --weight-transfer-config '{"backend": "xccl_rs"}'``.
    TRL calls it on its main process only; the other ranks run the weights' iterator themselves.
    The keyword arguments are :class:`XcclRsTrainerInitInfo`'s."""

    def __init__(self, vllm_client, *, master_address: str = "", master_port: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 1800.0, device: str = "cpu",
                 worker_bucket_device: str = "cpu", group_backend: str = "xccl_rs", payload: str = "full",
                 fp8_scale: str = "block", fp8_select=None, delta_base: str = "copy",
                 shared_memory: Optional[bool] = None) -> None:
        self.vllm = vllm_client
        self.options = dict(master_address=master_address, master_port=master_port, bucket_bytes=bucket_bytes,
                            timeout_s=timeout_s, device=device, worker_bucket_device=worker_bucket_device,
                            group_backend=group_backend, payload=payload, fp8_scale=fp8_scale,
                            fp8_select=fp8_select, delta_base=delta_base, shared_memory=shared_memory)
        self.engine = None

    def init_weight_transfer(self) -> None:
        wait = getattr(self.vllm, "wait_for_server_ready", None)
        if wait is not None:
            wait()
        from . import XcclRsTrainerInitInfo, XcclRsTrainerWeightTransferEngine

        info = XcclRsTrainerInitInfo(world_size=1 + int(self.vllm.get_world_size()), rank=0, **self.options)
        self.engine = XcclRsTrainerWeightTransferEngine.trainer_init(info, client=self.vllm, source=None)

    def pause(self) -> None:
        self.vllm.pause()

    def send_weights(self, iterator) -> None:
        if self.engine is None:
            raise RuntimeError("TRLWeightTransfer: send_weights before init_weight_transfer")
        self.engine.send_weights(iterator)

    def resume(self) -> None:
        self.vllm.resume()

    def destroy(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
