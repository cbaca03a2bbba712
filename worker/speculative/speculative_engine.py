"""``speculative_engine``: an engine with the speculative decoding its config names plugged in.

The engine owns the interface (``tidegate.worker.engine.speculation``) and imports none of this
folder; this builder knows both sides: it picks the proposer ``EngineConfig.speculative`` names
(prompt-lookup n-grams, or a draft model), the verifier and the governor, and hands the engine
the factory that makes them once the engine has built its runners. The worker
(``tidegate.worker.service.service.build_engine``), the tests and the benchmarks build
speculative engines here.
"""

from __future__ import annotations

from functools import partial

from tidegate.model_files.tokenizer import Tokenizer
from tidegate.worker.engine.block_manager import BlockManager
from tidegate.worker.engine.engine import Engine, EngineConfig
from tidegate.worker.engine.kv_cache import KVCacheSpec
from tidegate.worker.engine.model_runner import ModelRunner
from tidegate.worker.engine.speculation import Proposer, Speculation
from tidegate.worker.models.decoder import DecoderModel
from tidegate.worker.speculative.draft_model_speculator import DraftModelSpeculator
from tidegate.worker.speculative.draft_verifier import DraftVerifier
from tidegate.worker.speculative.ngram_speculator import NgramSpeculator
from tidegate.worker.speculative.speculation_governor import SpeculationGovernor


def speculative_engine(model: DecoderModel, tokenizer: Tokenizer, config: EngineConfig, *,
                       draft: DecoderModel | None = None) -> Engine:
    """The engine of ``config``: speculating as ``config.speculative`` says (plain when it is
    None). ``draft``: the draft model of ``speculative="draft"``, on the model's device,
    sharing its tokenizer."""
    make = (None if config.speculative is None
            else partial(speculation, config, model.cfg.vocab_size))
    return Engine(model, tokenizer, config, speculation=make, draft=draft)


def speculation(config: EngineConfig, vocab_size: int, target: ModelRunner,
                draft: ModelRunner | None, kv_spec: KVCacheSpec) -> Speculation:
    """The parts of a speculative engine: its proposer (a draft model's over a cache of as
    many blocks as the target's), the verifier drawing with the target's sampler's streams,
    and the governor. ``vocab_size``: the target's (a draft never proposes ids past it)."""
    proposer: Proposer
    if config.speculative == "ngram":
        proposer = NgramSpeculator(config.num_speculative_tokens)
    else:
        assert draft is not None  # the engine checks a draft model is given
        proposer = DraftModelSpeculator(
            draft, BlockManager(kv_spec.num_blocks, config.block_size,
                                prefix_caching=config.prefix_caching),
            config.num_speculative_tokens, vocab_size)
    return Speculation(proposer, DraftVerifier(target.sampler),
                       SpeculationGovernor(max_batch=config.speculative_max_batch))
