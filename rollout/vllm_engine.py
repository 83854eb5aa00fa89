"""The vLLM engine (extra `gpu`): the engine interface over vLLM's `LLMEngine`.

vLLM does the continuous batching and paged KV cache itself; this class maps each unfinished
sample to one vLLM request (`n=1`, the prompt plus the completion so far as token ids), reads back
the sampled tokens with their logprobs (`SamplingParams(logprobs=0)` returns the sampled token's
own), and tags each with the policy version loaded when the step that produced it ran.

Logprob convention: the engine is built with `logprobs_mode="processed_logprobs"`, vLLM's logprobs
after temperature scaling and top-p filtering, i.e. the distribution actually sampled from, the
same convention as the torch engine (`fleetrl.rollout.sampling`). vLLM's default (`raw_logprobs`)
would ignore the temperature.

Weights: `stage_weights` tensors are written to one safetensors file (tmpfs where available) and
every worker reloads them in place through `collective_rpc` (`_vllm_worker.FleetrlWeightLoader`),
between two `step()` calls. Along a delta chain `WeightSync` stages only the tensors the chain changed
(`complete=False`, `_load_part`): the file holds those alone, and the model's `load_weights` replaces
exactly them (vLLM's parameters are fused and sharded under other names, so the positions of single
changed elements cannot be scattered into them from here). LoRA adapters (a run with `model.lora`) go
through vLLM's own LoRA support instead: the engine is built with `enable_lora`, each adapter version
is written as a peft folder and loaded with `add_lora` as one `LoRARequest` (id = version + 1), and
every request runs under the newest one. The switch holds between two steps as for full weights: the
samples in flight are aborted and added again (prompt plus their tokens so far) under the new adapter,
and the previous adapter is removed.

Sampling randomness: vLLM's per-request `seed`, derived from the sample key and the position the
request starts at; a resumed sample is deterministic under that seed but, unlike the torch engine,
not token-identical to an uninterrupted run.

vllm is imported lazily, only when this engine is built. Not run in this repository's CI (no GPU):
see docs/rollout.md for exactly what was and was not exercised.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from fleetrl.hub import save_peft_adapter
from fleetrl.rollout.adapters import LoraWeights
from fleetrl.rollout.engine import Engine, SeqState
from fleetrl.rollout.errors import EngineError

_WORKER_EXTENSION = "fleetrl.rollout._vllm_worker.FleetrlWeightLoader"
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts (`vllm.config.lora.MaxLoRARanks`)."""


def max_lora_rank(r: int) -> int:
    """The smallest rank vLLM can be configured with that holds adapters of rank `r`."""
    for rank in _LORA_RANKS:
        if rank >= r:
            return rank
    raise EngineError(f"model.lora.r is {r}; vLLM serves adapters of rank {_LORA_RANKS[-1]} at most")


class VllmEngine(Engine):
    def __init__(self, llm_engine: Any, *, eos_ids: list[int], max_context: int, version: int = 0) -> None:
        super().__init__(eos_ids=eos_ids, max_context=max_context, version=version)
        self.llm = llm_engine
        self._requests: dict[str, SeqState] = {}
        self._weights_dir = tempfile.mkdtemp(prefix="fleetrl-vllm-weights-",
                                             dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._lora: Any = None
        """The `LoRARequest` of the adapter version requests run under (None: the base alone)."""

    @classmethod
    def from_config(cls, model_config: Any, engine_config: Any, version: int = 0) -> VllmEngine:
        try:
            from vllm import EngineArgs, LLMEngine  # type: ignore[import-not-found, unused-ignore]
        except ImportError as exc:
            raise EngineError("engine kind 'vllm' needs the `gpu` extra (pip install 'fleetrl[gpu]')") from exc
        if model_config.path is None:
            raise EngineError("engine kind 'vllm' needs model.path (a local Hugging Face checkpoint)")
        lora: dict[str, Any] = {}
        if model_config.lora is not None:  # two adapters at a time: the one running and the one switched to
            lora = {"enable_lora": True, "max_lora_rank": max_lora_rank(model_config.lora.r), "max_loras": 2}
        args = EngineArgs(
            model=model_config.path, dtype=engine_config.dtype, seed=0,
            gpu_memory_utilization=engine_config.gpu_memory_utilization,
            tensor_parallel_size=engine_config.tensor_parallel_size, max_num_seqs=engine_config.max_num_seqs,
            enforce_eager=engine_config.enforce_eager, logprobs_mode="processed_logprobs",
            worker_extension_cls=_WORKER_EXTENSION, **lora,
        )
        llm = LLMEngine.from_engine_args(args)
        hf = llm.model_config.hf_config
        eos = hf.eos_token_id if isinstance(hf.eos_token_id, list) else [hf.eos_token_id]
        return cls(llm, eos_ids=[int(e) for e in eos if e is not None], max_context=int(llm.model_config.max_model_len),
                   version=version)

    def has_work(self) -> bool:
        return bool(self._requests)

    def _enqueue(self, seqs: list[SeqState]) -> None:
        from vllm import SamplingParams  # type: ignore[import-not-found, unused-ignore]
        from vllm.inputs import TokensPrompt  # type: ignore[import-not-found, unused-ignore]
        from vllm.sampling_params import RequestOutputKind  # type: ignore[import-not-found, unused-ignore]

        for seq in seqs:
            request_id = f"{seq.group_id}/{seq.index}/{seq.position}"
            if self._lora is not None:  # a sample added again under a new adapter is a new request
                request_id += f"/a{self._lora.lora_int_id}"
            params = SamplingParams(
                n=1, temperature=seq.sampling.temperature, top_p=seq.sampling.top_p,
                max_tokens=seq.sampling.max_new_tokens - len(seq.tokens), logprobs=0,
                seed=(seq.key ^ seq.position) & 0x7FFFFFFF, stop_token_ids=sorted(self.eos_ids),
                output_kind=RequestOutputKind.DELTA, detokenize=False,
            )
            self.llm.add_request(request_id, TokensPrompt(prompt_token_ids=seq.prompt_ids + seq.tokens), params,
                                 lora_request=self._lora)
            self._requests[request_id] = seq

    def _withdraw(self, seqs: list[SeqState]) -> None:
        gone = {id(s) for s in seqs}
        ids = [rid for rid, s in self._requests.items() if id(s) in gone]
        if ids:
            self.llm.abort_request(ids)
        for rid in ids:
            del self._requests[rid]

    def _decode_step(self) -> None:
        for out in self.llm.step():
            seq = self._requests.get(out.request_id)
            if seq is None:
                continue  # aborted meanwhile
            completion = out.outputs[0]
            for token, logprobs in zip(completion.token_ids, completion.logprobs or [], strict=True):
                if seq.finish_reason is None:
                    self._append(seq, int(token), float(logprobs[token].logprob))
            if out.finished:
                if seq.finish_reason is None:
                    seq.finish_reason = _FINISH.get(str(completion.finish_reason), "abort")
                del self._requests[out.request_id]

    def _load_part(self, tensors: Mapping[str, Any]) -> None:
        """Only the tensors a version changed: the workers' `load_weights` replaces exactly those."""
        self._load_weights(tensors)

    def _load_weights(self, tensors: Mapping[str, Any]) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self._weights_dir, "staged.safetensors")
        unique: dict[str, Any] = {}
        seen: set[int] = set()
        for name, t in tensors.items():  # tied tensors once: safetensors refuses shared storage
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                unique[name] = t.contiguous()
        save_file(unique, path)
        self.llm.collective_rpc("fleetrl_load_weights", args=(path,))

    def _load_adapter(self, adapter: LoraWeights | None) -> None:
        from vllm.lora.request import LoRARequest  # type: ignore[import-not-found, unused-ignore]

        previous = self._lora
        self._lora = None
        if adapter is not None:
            folder = os.path.join(self._weights_dir, f"adapter-{adapter.version}")
            save_peft_adapter(folder, adapter.info, adapter.tensors)
            self._lora = LoRARequest(f"fleetrl-v{adapter.version}", adapter.version + 1, folder)
            if not self.llm.add_lora(self._lora):
                raise EngineError(f"vLLM did not load adapter version {adapter.version} from {folder}")
        # The samples in flight go on under the new adapter from the next step: added again with their
        # tokens so far (vLLM's prefix cache keeps the recompute short).
        running = [s for s in self._requests.values() if s.finish_reason is None]
        self._withdraw(running)
        self._enqueue(running)
        if previous is not None:
            self.llm.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self._weights_dir, ignore_errors=True)
