"""A loaded ``hf`` model that answers chat conversations with tools, batched.

Prompts are the tokenizer's chat template: called with ``tools=`` when the template
renders tools (it mentions ``tools``), else with the tools rendered into the system message
by :func:`services.chat.render.messages_with_tools_prompt` (SmolLM2-Instruct's template is
of this kind). The model's output is parsed into tool calls by
:func:`services.chat.toolcalls.parse_assistant_output`.

Generation is batched with left padding. Sampling is the tiny family's counter-based
Gumbel-max (:mod:`services.training.rng`): ``transformers.generate`` runs greedy over
``logits / T + gumbel(row seed, token index)`` (:class:`GumbelNoise`), so a row's sample
depends on its own seed alone, not on its batch neighbours or on torch's global generator
(a GRPO group sampled on one rank or two draws the same tokens, up to float rounding of
the padded batch).

On CUDA the weights are bf16 (the usual serving precision for these models); on CPU fp32,
where bf16 matmuls are slower on most hosts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.chat.render import messages_with_tools_prompt
from services.chat.stops import stop_token_ids
from services.environments.base import Environment, TaskSpec
from services.environments.chat import as_chat_environment
from services.training.checkpoint import Manifest
from services.training.device import resolve_device
from services.training.family import EpisodeFeed, Rollouts, SampledBy, TokenEpisode
from services.training.hf.checkpoint import LoadedHF, load_hf_checkpoint
from services.training.hf.rollout import Completion
from services.training.rng import derive_seed, gumbel

if TYPE_CHECKING:
    from services.inference.engine import Engine
    from services.inference.remote import RemoteEngine, RemotePolicy
    from services.inference.rollout import ChatRollout
    from services.inference.utilisation import TimeSplit, Utilisation


def model_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class HFModel:
    """An hf checkpoint ready to roll out chat episodes (evaluation, GRPO, serving)."""

    family = "hf"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: torch.device,
        manifest: Manifest | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.manifest = manifest
        self.checkpoint_id = manifest.checkpoint_id if manifest else None
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.template_takes_tools = "tools" in str(getattr(tokenizer, "chat_template", "") or "")
        # Where rollouts decode: None here, else a server (services.inference.remote).
        self.remote: RemotePolicy | None = None

    @classmethod
    def load(
        cls, path: Path | str, device: str = "auto", *, base_dir: Path | None = None
    ) -> HFModel:
        """Verify and load an hf checkpoint (full or LoRA on its base) for inference."""
        resolved = resolve_device(device)
        loaded = load_hf_checkpoint(
            path, device=resolved, dtype=model_dtype(resolved), base_dir=base_dir
        )
        return cls.from_loaded(loaded, resolved)

    @classmethod
    def from_loaded(cls, loaded: LoadedHF, device: torch.device) -> HFModel:
        """For inference an adapter is folded into (a copy of) its base's weights: the same
        outputs as the unmerged peft model without its per-layer extra matmuls."""
        model = loaded.model
        if hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        model.eval()
        return cls(model, loaded.tokenizer, device=device, manifest=loaded.manifest)

    @property
    def end_of_turn_id(self) -> int:
        """The token that closes an assistant turn: ChatML's ``<|im_end|>`` if the vocabulary
        has it (Qwen, SmolLM2), else end-of-sequence."""
        end_of_turn = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id:
            return end_of_turn
        return int(self.tokenizer.eos_token_id)

    @property
    def stop_ids(self) -> list[int]:
        """Where a generated turn ends: the rule the model server stops by too."""
        generation = getattr(self.model, "generation_config", None)
        return sorted(stop_token_ids(self.tokenizer, generation) | {self.end_of_turn_id})

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> str:
        """The prompt text for the next assistant turn."""
        if tools and self.template_takes_tools:
            text = self.tokenizer.apply_chat_template(
                list(messages), tools=list(tools), add_generation_prompt=True, tokenize=False
            )
        else:
            text = self.tokenizer.apply_chat_template(
                messages_with_tools_prompt(messages, tools),
                add_generation_prompt=True,
                tokenize=False,
            )
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def rollouts(
        self,
        env: Environment,
        tasks: Sequence[TaskSpec],
        *,
        seeds: Sequence[int],
        max_turns: int,
        max_new_tokens: int,
        temperature: float,
        max_rows: int | None = None,
        feed: EpisodeFeed | None = None,
    ) -> Rollouts:
        """One chat episode per task, and ``feed``'s as rows free, through the inference
        engine (:mod:`services.inference`: the system text and tool list every prompt starts
        with, a GRPO group's shared prompt and each episode's earlier turns are prefilled
        once), each scored by the environment's chat verifier as it ends (ValueError for an
        environment without a chat rendering).

        The engine is made per call, so its prefix cache never outlives the weights it was
        computed under (a trainer updates them between calls). With :attr:`remote` set the
        turns decode on that server instead, the engine rendering and decoding for it."""
        from services.inference.hf import HFEngine
        from services.inference.rollout import EpisodeStream, RolloutSettings
        from services.inference.rollout import run_chat_episodes as run_on_engine
        from services.inference.utilisation import TimeSplit

        chat_env = as_chat_environment(env)
        split, started = TimeSplit(), time.perf_counter()
        engine = HFEngine(
            self.model,
            self.tokenizer,
            path=f"checkpoint:{self.checkpoint_id}" if self.checkpoint_id else "memory",
            version=self.checkpoint_id or "",
        )
        episodes: dict[int, TokenEpisode] = {}

        def ended(i: int, rollout: ChatRollout) -> None:
            with split.part("tool_calls"):  # the verifier
                reward = chat_env.chat_verify(rollout.task, rollout.episode)
            episodes[i] = TokenEpisode(
                task=rollout.task,
                turns=[(turn.prompt_ids, turn.completion_ids) for turn in rollout.turns],
                reward=reward,
                end_reason=rollout.episode.end_reason,
                answer=rollout.episode.final_answer,
                sampler_logprobs=[list(turn.logprobs) for turn in rollout.turns],
            )
            if feed is not None:
                feed.episode_ended(i, episodes[i])

        with self._rollout_engine(engine) as rollout_engine:
            rollouts, stats = run_on_engine(
                rollout_engine,
                chat_env,
                tasks,
                seeds=seeds,
                settings=RolloutSettings(
                    max_turns,
                    max_new_tokens,
                    temperature,
                    max_rows=max_rows,
                    max_prompt_tokens=None,
                ),
                split=split,
                stream=EpisodeStream(None if feed is None else feed.next_episode, ended),
            )
            sampler = _sampled_by(rollout_engine)
        ordered = [episodes[i] for i in range(len(rollouts))]
        utilisation = self._utilisation(ordered, split, time.perf_counter() - started)
        return Rollouts(ordered, stats.generated_tokens, stats.prompt_tokens, sampler, utilisation)

    def _utilisation(
        self, episodes: Sequence[TokenEpisode], split: TimeSplit, wall_s: float
    ) -> Utilisation:
        """The round's FLOPs against this machine's peak and its time split (none when the
        turns decoded on a remote server: its machine did the work)."""
        from services.inference.utilisation import Utilisation, round_utilisation

        if self.remote is not None:
            return Utilisation()
        turns = [turn for episode in episodes for turn in episode.turns]
        return round_utilisation(self.model, turns, split, wall_s)

    def _rollout_engine(self, engine: Engine) -> AbstractContextManager[Engine | RemoteEngine]:
        """The engine the rollouts decode on: ``engine`` here, or the remote server's."""
        if self.remote is None:
            return nullcontext(engine)
        return self.remote.engine(engine)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | Sequence[int] = 0,
    ) -> list[Completion]:
        """Complete each prompt up to an end-of-turn token or ``max_new_tokens``.

        ``seed`` is one run seed (row ``i`` uses ``derive_seed(seed, i)``) or one per row.
        """
        if not prompts:
            return []
        seeds = (
            [derive_seed(seed, i) for i in range(len(prompts))]
            if isinstance(seed, int)
            else list(seed)
        )
        if len(seeds) != len(prompts):
            raise ValueError("need one seed per prompt")
        encoded = [self.encode(p) for p in prompts]
        width = max(len(ids) for ids in encoded)
        pad = int(self.tokenizer.pad_token_id)
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)  # (B, T)
        attention = torch.zeros((len(encoded), width), dtype=torch.long)  # (B, T)
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention[row, width - len(ids) :] = 1
        from transformers import LogitsProcessorList

        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            noise = GumbelNoise(seeds, temperature, prompt_width=width, device=self.device)
            sampling["logits_processor"] = LogitsProcessorList([noise])
        stop = self.stop_ids
        output = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            max_new_tokens=max_new_tokens,
            eos_token_id=stop,
            pad_token_id=pad,
            **sampling,
        )  # (B, T + new)
        completions = []
        for row, ids in enumerate(encoded):
            new = output[row, width:].tolist()
            end = next((i for i, t in enumerate(new) if t in stop), None)
            kept = new if end is None else new[: end + 1]
            text_ids = kept if end is None else kept[:-1]
            completions.append(
                Completion(
                    prompt_ids=ids,
                    completion_ids=kept,
                    text=self.tokenizer.decode(text_ids, skip_special_tokens=True),
                    truncated=end is None,
                )
            )
        return completions


def _sampled_by(engine: object) -> SampledBy | None:
    """Who sampled, when it was another engine than this process's (the remote backend)."""
    from services.inference.remote import RemoteEngine

    if not isinstance(engine, RemoteEngine):
        return None
    return SampledBy(
        url=engine.client.backend.url,
        served_name=engine.served_name,
        published_id=engine.published_id,
        served_versions=tuple(sorted(engine.served_versions)),
    )


class GumbelNoise:
    """A logits processor that turns greedy decoding into sampling at ``temperature``:
    ``logits / T + gumbel(seed of the row, index of the token)``, whose argmax is a sample
    of softmax(logits / T) (Gumbel-max), keyed by each row's seed alone."""

    def __init__(
        self, seeds: Sequence[int], temperature: float, *, prompt_width: int, device: torch.device
    ):
        self.seeds = torch.tensor([s & 0xFFFFFFFF for s in seeds], dtype=torch.int64, device=device)
        self.temperature = float(temperature)
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = int(input_ids.shape[1]) - self.prompt_width  # index of the token being drawn
        noise = gumbel(self.seeds, step, scores.shape[-1])  # (B, V) float64
        return scores.double() / self.temperature + noise  # (B, V)
