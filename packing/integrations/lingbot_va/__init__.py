"""Train LeRobot's LingBot-VA packed: ``pip install -e '.[lingbot]'``.

    policy = LingBotVAPolicy.from_pretrained(path, config=config)   # attn_mode="flex"
    packed = install(policy, latent_hw=(24, 40))     # LeRobot's transformer, unmodified
    collate = packed.collator(token_budget=64 * 240)  # 240 latent tokens a frame
    loss = packed.loss(batch, "episode")              # batch.extras: seed, step

K whole episodes train in one static-shape sequence: each episode's clean and noisy copies of
its latent frames and actions side by side (`DualStreamTokens`), LingBot-VA's mask as named
mask_mods (`lingbot_va_mask` = (`clean_to_clean` | `noise_to_clean` | `noise_to_noise`) &
`chunk_window`) AND-ed with the document mask, per-episode chunk size and window, and
LeRobot's own draws per episode (`draw_episode`, `EpisodeDraws`), keyed by (seed, step,
episode), so the pack trains on exactly what LeRobot's ``training_loss_from_streams`` sees one
episode at a time. Losses: `REDUCTIONS` ("episode": LingBot-VA's trainer; "frame": LeRobot's
batch mean), exact under packing, accumulation and data parallelism.

- `install` -> `PackedLingBotVA` (``collator``, ``forward`` -> per-token losses, ``loss``,
  ``reference`` (LeRobot's own path), ``uninstall``).
- `lingbot_episodes`: episodes from a LeRobot latent dataset plus text embeddings.
- `dual_stream_tokens` -> `DualStreamTokens`: the joint layout and per-token attributes.
- `packing.integrations.lingbot_va.testing`: tiny policies from LeRobot's classes
  (``packing verify --model packing.integrations.lingbot_va.testing:tiny_lingbot_va``).

Serve it to many robots at once (docs/lingbot-va-serving.md):

- `LingBotVAEngine` (the engine over `ServedLingBotVA`, the per-model Packs), `LingShape`
  (its static packs; `phase_shapes`: the default, each loop alone and mixed),
  `ChunkRequest` (a robot's next chunk: its episode so far);
- `LingBotVAAdapter`: a LeRobot LingBot-VA client's observation through ``packing serve``
  (``LingBotVAAdapter.from_policy(policy)``: the policy's own VAE and UMT5, a VAE cache per
  episode: `PolicyEncoders`);
- `prove_serving` -> `ServingReport`: served == LeRobot's ``predict_action_chunk`` per robot
  alone (``packing verify --inference --model lingbot_va``).

docs/lingbot-va.md and docs/lingbot-va-serving.md have the recipes and the proofs.
"""

from packing._lazy import require

require("lerobot.policies.lingbot_va", extra="lingbot")

from packing.integrations.lingbot_va._draws import EpisodeDraws, draw_episode  # noqa: E402
from packing.integrations.lingbot_va._episodes import lingbot_episodes  # noqa: E402
from packing.integrations.lingbot_va._loss import REDUCTIONS  # noqa: E402
from packing.integrations.lingbot_va._mask import (  # noqa: E402
    chunk_window,
    clean_to_clean,
    lingbot_va_mask,
    noise_to_clean,
    noise_to_noise,
)
from packing.integrations.lingbot_va._packed import PackedLingBotVA, install  # noqa: E402
from packing.integrations.lingbot_va._serve import (  # noqa: E402
    LingBotVAEngine,
    ServedLingBotVA,
)
from packing.integrations.lingbot_va._serve_adapter import LingBotVAAdapter  # noqa: E402
from packing.integrations.lingbot_va._serve_encoders import PolicyEncoders  # noqa: E402
from packing.integrations.lingbot_va._serve_packs import LingShape, phase_shapes  # noqa: E402
from packing.integrations.lingbot_va._serve_proof import (  # noqa: E402
    ServingReport,
    prove_serving,
)
from packing.integrations.lingbot_va._serve_request import ChunkRequest  # noqa: E402
from packing.integrations.lingbot_va._tokens import (  # noqa: E402
    DualStreamTokens,
    dual_stream_tokens,
)

__all__ = [
    "REDUCTIONS",
    "ChunkRequest",
    "DualStreamTokens",
    "EpisodeDraws",
    "LingBotVAAdapter",
    "LingBotVAEngine",
    "LingShape",
    "PackedLingBotVA",
    "PolicyEncoders",
    "ServedLingBotVA",
    "ServingReport",
    "chunk_window",
    "clean_to_clean",
    "draw_episode",
    "dual_stream_tokens",
    "install",
    "lingbot_episodes",
    "lingbot_va_mask",
    "noise_to_clean",
    "noise_to_noise",
    "phase_shapes",
    "prove_serving",
]
