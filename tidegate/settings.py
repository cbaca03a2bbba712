"""Settings every role reads from the environment (``TIDEGATE_*``) or the command line."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIDEGATE_", extra="ignore")

    # REDIS_URL (unprefixed, the common convention) also works; see `load_settings`.
    redis_url: str = DEFAULT_REDIS_URL
    model: str = Field(default="smollm2", description="smollm2 | HF dir | .gguf | random:<preset>")
    device: str = "cpu"
    dtype: str = Field(default="auto", pattern="^(auto|float32|bfloat16|float16)$",
                       description="auto: float32 on CPU, bfloat16 on CUDA")
    max_num_seqs: int = Field(default=32, ge=1)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    block_size: int = Field(default=16, ge=1, le=256)
    kv_cache_gb: float | None = Field(default=None, gt=0,
                                      description="None: 2 GiB on CPU, a fraction on CUDA")
    kv_cache_memory_fraction: float = Field(default=0.9, gt=0, le=1)
    prefix_caching: bool = True
    default_timeout_s: float = Field(default=300.0, gt=0)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, lt=65536)
    # Base URL clients stream from (ws:// or wss://); None: the API's own address, ws scheme.
    gateway_url: str | None = None
    lane_partitions: int = Field(default=1, ge=1)
    job_ttl_s: int = Field(default=24 * 3600, ge=60)
    log_level: str = "INFO"


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit (non-None) overrides from the CLI on top."""
    import os

    base: dict[str, object] = {}
    if "TIDEGATE_REDIS_URL" not in os.environ and os.environ.get("REDIS_URL"):
        base["redis_url"] = os.environ["REDIS_URL"]
    base.update({k: v for k, v in overrides.items() if v is not None})
    return Settings(**base)  # type: ignore[arg-type]
