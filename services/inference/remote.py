"""The remote backend: episodes decoded by an OpenAI-compatible server instead of in the job.

A train job's rollouts and an eval job's episodes run through
:func:`services.inference.rollout.run_chat_episodes` either way; with a
:class:`RemoteEngine` every turn is one ``POST /v1/completions`` to the server (vLLM in
production, ``ratchet serve`` in tests) instead of a row of a local
:class:`~services.inference.engine.ActiveBatch`. This is how rollouts scale past one
machine: the job keeps its GPU for the backward pass and the server batches every turn of
every episode (continuous batching, prefix caching) on its own.

Token in, token out: the job renders each prompt with its own copy of the family's template
and tokenizer (the local engine, whose weights are never run here), sends the ids as the
prompt, and takes the sampled ids and their log-probs from the response (vLLM's
``return_token_ids`` and ``logprobs: 0``), so nothing is re-tokenized and training scores
exactly what was sampled. A response whose ``prompt_token_ids`` differ from what was sent is
refused. The log-probs are the raw model's (temperature 1), vLLM's default
``--logprobs-mode raw_logprobs`` and what the local engine reports. The trainer compares
them with its own (:mod:`services.training.mismatch`), so :class:`RemoteEngine` keeps what
names the weights that answered: the checkpoint id the job published and the versions
``ratchet serve`` says decoded (``X-Ratchet-Model-Version``).

The weights being trained reach the server as a LoRA adapter: before each call's rollouts
:class:`RemotePolicy` writes them (the trainer's ``save``) into a directory the server can
read (``shared_dir``, a volume both mount), loads them with ``/v1/load_lora_adapter`` under
a fresh name, rolls out under that name, and unloads them after (``/v1/unload_lora_adapter``)
and removes the directory. An eval job loads the checkpoint it evaluates the same way.

Against ``ratchet serve`` the episodes are token-identical to the local engine's on the same
model and seeds, greedy and sampled (its choice 0 samples as an engine row with the
request's seed does; tested against a real process). vLLM's greedy episodes are too; its
sampled ones are reproducible per seed but drawn by its own sampler.

Every failure is a :class:`RemoteError` naming the URL: the server unreachable, a 4xx/5xx
(with the server's own message), no answer within ``timeout_s``, or an answer without the
token ids. Standard library only (``urllib``): the job image needs nothing more.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import urlparse

from services.chat.http import urlopen
from services.chat.protocol import ChatMessage
from services.inference.engine import Engine, FinishReason, GenerationRequest, GenerationResult
from services.inference.rollout_env import API_KEY_ENV, MODEL_ENV, SHARED_DIR_ENV, URL_ENV

# The header ``ratchet serve`` answers with the checkpoint id of the weights that decoded
# (services.modelserver.openai_api.VERSION_HEADER; vLLM sends none).
VERSION_HEADER = "X-Ratchet-Model-Version"

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_CONCURRENCY = 64
_CONFIG_KEYS = frozenset(
    {"url", "model", "shared_dir", "api_key_env", "timeout_s", "max_concurrency"}
)

Tag = TypeVar("Tag")


class RemoteError(RuntimeError):
    """The rollout server failed a request; the message names the URL and why."""


@dataclass(frozen=True)
class RemoteBackend:
    """Where rollouts go: the server's base URL (``http://vllm:8000``), the served base
    model's name, and the directory both the job and the server mount for the weights."""

    url: str
    model: str
    shared_dir: Path | None = None
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_concurrency: int = DEFAULT_CONCURRENCY

    @classmethod
    def from_config(
        cls, raw: object, environ: Mapping[str, str], *, key: str = "rollout_backend"
    ) -> RemoteBackend:
        """A job spec's ``rollout_backend`` object, checked; ValueError naming the bad key.
        The API key is read from the env var ``api_key_env`` names (a spec holds no secret)."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{key} must be an object with 'url' and 'model'")
        unknown = sorted(set(raw) - _CONFIG_KEYS)
        if unknown:
            raise ValueError(
                f"{key}.{unknown[0]} is not a rollout_backend key "
                f"(known: {', '.join(sorted(_CONFIG_KEYS))})"
            )
        url = raw.get("url")
        parsed = urlparse(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"{key}.url must be an http(s) URL such as http://vllm:8000")
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"{key}.model must name the served base model")
        shared = raw.get("shared_dir")
        if shared is not None and (not isinstance(shared, str) or not shared):
            raise ValueError(f"{key}.shared_dir must be a directory path")
        env_name = raw.get("api_key_env", API_KEY_ENV)
        if not isinstance(env_name, str) or not env_name:
            raise ValueError(f"{key}.api_key_env must name an environment variable")
        timeout = raw.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"{key}.timeout_s must be a positive number of seconds")
        concurrency = raw.get("max_concurrency", DEFAULT_CONCURRENCY)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"{key}.max_concurrency must be a positive integer")
        return cls(
            url=url.rstrip("/") if isinstance(url, str) else "",
            model=model,
            shared_dir=Path(shared) if isinstance(shared, str) else None,
            api_key=environ.get(env_name) or None,
            timeout_s=float(timeout),
            max_concurrency=concurrency,
        )


class RemoteClient:
    """The few calls rollouts make, over ``urllib``; every failure a :class:`RemoteError`."""

    def __init__(self, backend: RemoteBackend) -> None:
        self.backend = backend

    def post(self, path: str, body: Mapping[str, Any]) -> bytes:
        return self.send(path, body)[0]

    def send(self, path: str, body: Mapping[str, Any]) -> tuple[bytes, str | None]:
        """POST ``body``; the answer's bytes and the version the server says answered
        (``ratchet serve``'s ``X-Ratchet-Model-Version``; None from servers without it)."""
        url = f"{self.backend.url}{path}"
        headers = {"Content-Type": "application/json"}
        if self.backend.api_key:
            headers["Authorization"] = f"Bearer {self.backend.api_key}"
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with urlopen(request, timeout=self.backend.timeout_s) as response:  # no key leaves
                return bytes(response.read()), response.headers.get(VERSION_HEADER)
        except urllib.error.HTTPError as exc:
            raise RemoteError(f"{url} answered {exc.code}: {_server_message(exc)}") from None
        except TimeoutError:
            raise RemoteError(f"{url} did not answer within {self.backend.timeout_s:g}s") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError | socket.timeout):
                raise RemoteError(
                    f"{url} did not answer within {self.backend.timeout_s:g}s"
                ) from None
            raise RemoteError(f"cannot reach {url}: {exc.reason}") from None
        except OSError as exc:  # a connection reset mid-answer
            raise RemoteError(f"{url} failed: {exc}") from None

    def post_json(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.send_json(path, body)[0]

    def send_json(self, path: str, body: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        """:meth:`send`, the answer a JSON object."""
        raw, version = self.send(path, body)
        try:
            answer = json.loads(raw)
        except ValueError:
            raise RemoteError(f"{self.backend.url}{path} answered something not JSON") from None
        if not isinstance(answer, dict):
            raise RemoteError(f"{self.backend.url}{path} answered a JSON {type(answer).__name__}")
        return answer, version

    def load_adapter(self, name: str, path: Path) -> None:
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def unload_adapter(self, name: str) -> None:
        self.post("/v1/unload_lora_adapter", {"lora_name": name})


def _server_message(error: urllib.error.HTTPError) -> str:
    """The server's own words: OpenAI's ``error.message`` (vLLM's and ours), else the body."""
    try:
        body = error.read().decode("utf-8", "replace")
    except OSError:
        return str(error.reason)
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:500] or str(error.reason)
    if isinstance(parsed, dict):
        inner = parsed.get("error", parsed)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
    return body[:500]


class RemoteEngine:
    """What :func:`~services.inference.rollout.run_chat_episodes` needs of an engine, with
    the decoding done by the server: ``local`` renders and decodes (its template and
    tokenizer; its weights are not run), ``served_name`` is what the server decodes with.

    A context manager: its request threads stop when it closes."""

    def __init__(
        self,
        local: Engine,
        client: RemoteClient,
        served_name: str,
        *,
        published_id: str | None = None,
    ) -> None:
        self.local = local
        self.client = client
        self.served_name = served_name
        # the checkpoint id of the weights the job loaded under ``served_name`` (None: the
        # served base model), and the versions the server said answered
        self.published_id = published_id
        self.served_versions: set[str] = set()
        self.family = local.family
        self.eos_ids = local.eos_ids
        self._pool = ThreadPoolExecutor(
            max_workers=client.backend.max_concurrency, thread_name_prefix="ratchet-remote"
        )

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]]) -> list[int]:
        return self.local.render(messages, tools)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.local.decode_text(ids)

    def context_length(self) -> int:
        return self.local.context_length()

    def open_batch(self) -> RemoteBatch[Any]:
        return RemoteBatch(self)

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        return self._pool.submit(self.complete, request)

    def complete(self, request: GenerationRequest) -> GenerationResult:
        """One turn on the server: the prompt as ids, the sampled ids and log-probs back."""
        sampling = request.sampling
        body: dict[str, Any] = {
            "model": self.served_name,
            "prompt": list(request.prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        answer, version = self.client.send_json("/v1/completions", body)
        if version:
            self.served_versions.add(version)
        return self.result_of(request, answer)

    def result_of(self, request: GenerationRequest, answer: dict[str, Any]) -> GenerationResult:
        """A turn's result from the server's answer (vLLM's shape or ours)."""
        where = f"{self.client.backend.url}/v1/completions"
        try:
            choice = answer["choices"][0]
            ids = [int(i) for i in choice["token_ids"]]
            logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
            finish = str(choice["finish_reason"])
            prompt_ids = choice.get("prompt_token_ids", answer.get("prompt_token_ids"))
        except (KeyError, IndexError, TypeError, ValueError):
            raise RemoteError(
                f"{where} answered without token ids and log-probs (the server must support "
                "'return_token_ids' and 'logprobs': vLLM 0.10.2 or later, or ratchet serve)"
            ) from None
        if prompt_ids is not None and list(prompt_ids) != list(request.prompt_ids):
            raise RemoteError(f"{where} decoded another prompt than the token ids it was sent")
        if len(logprobs) != len(ids):
            raise RemoteError(
                f"{where} answered {len(ids)} token ids but {len(logprobs)} log-probs"
            )
        ended = finish == FinishReason.STOP and bool(ids) and ids[-1] in self.eos_ids
        usage = answer.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return GenerationResult(
            token_ids=ids[:-1] if ended else ids,
            finish_reason=FinishReason.STOP if finish == FinishReason.STOP else FinishReason.LENGTH,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=int(details.get("cached_tokens") or 0),
            sampled_ids=ids,
            logprobs=logprobs,
        )


class RemoteBatch(Generic[Tag]):
    """The rows of :class:`~services.inference.engine.ActiveBatch`'s interface as requests
    in flight: ``join`` sends them, ``step`` returns those answered (at least one)."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine
        self._running: dict[Future[GenerationResult], Tag] = {}

    def __len__(self) -> int:
        return len(self._running)

    def join(self, requests: Sequence[tuple[GenerationRequest, Tag]]) -> None:
        for request, tag in requests:
            self._running[self.engine.submit(request)] = tag

    def step(self) -> list[tuple[Tag, GenerationResult]]:
        """Wait for the next answers; a failed request raises its :class:`RemoteError`."""
        if not self._running:
            return []
        done, _ = wait(list(self._running), return_when=FIRST_COMPLETED)
        finished = []
        for future in done:
            tag = self._running.pop(future)
            finished.append((tag, future.result()))
        return finished


@dataclass
class RemotePolicy:
    """The policy a job rolls out remotely: the weights being trained (``publish`` writes
    them into a directory), or a checkpoint the server can read as it is, or (neither) the
    served base model itself."""

    backend: RemoteBackend
    publish: Callable[[Path], object] | None = None
    checkpoint: Path | None = None

    def __post_init__(self) -> None:
        if self.publish is not None and self.backend.shared_dir is None:
            raise ValueError(
                "rollout_backend.shared_dir is required to roll out weights being trained: "
                "the job writes them there and the server loads them from there"
            )

    @contextmanager
    def engine(self, local: Engine) -> Iterator[RemoteEngine]:
        """A remote engine over the policy's weights, loaded on the server for the block and
        unloaded (their directory removed) after it, however it ends."""
        client = RemoteClient(self.backend)
        if self.publish is None and self.checkpoint is None:
            with RemoteEngine(local, client, self.backend.model) as engine:
                yield engine
            return
        name = f"ratchet-rollout-{uuid.uuid4().hex[:12]}"
        published: Path | None = None
        written: object = None
        if self.publish is not None:
            assert self.backend.shared_dir is not None  # checked in __post_init__
            published = self.backend.shared_dir / name
            written = self.publish(published)
        path = published if published is not None else self.checkpoint
        assert path is not None
        try:
            client.load_adapter(name, path)
            try:
                published_id = getattr(written, "checkpoint_id", None)
                with RemoteEngine(local, client, name, published_id=published_id) as engine:
                    yield engine
            finally:
                self._unload(client, name)
        finally:
            if published is not None:
                shutil.rmtree(published, ignore_errors=True)

    @staticmethod
    def _unload(client: RemoteClient, name: str) -> None:
        try:
            client.unload_adapter(name)
        except RemoteError as exc:  # the rollouts are done; a stale adapter is only memory
            logger.warning("unloading the rollout adapter %s failed: %s", name, exc)


def rollout_config(raw: object, environ: Mapping[str, str]) -> object | None:
    """The backend a job is pointed at: its spec's ``rollout_backend``, else the deployment's
    ``RATCHET_ROLLOUT_URL`` / ``_MODEL`` / ``_SHARED_DIR`` (which the worker sets for every
    job from its rollout endpoint, the key in ``RATCHET_ROLLOUT_API_KEY``, so every loop's
    jobs of a deployment roll out on its server); None: in the job."""
    if raw is not None:
        return raw
    url = environ.get(URL_ENV)
    if not url:
        return None
    model = environ.get(MODEL_ENV)
    if not model:
        raise ValueError(f"{MODEL_ENV} must name the served base model when {URL_ENV} is set")
    config: dict[str, object] = {"url": url, "model": model}
    if environ.get(SHARED_DIR_ENV):
        config["shared_dir"] = environ[SHARED_DIR_ENV]
    return config


def attach_rollout_backend(
    model: object, raw: object, environ: Mapping[str, str], *, checkpoint: Path | None = None
) -> RemoteBackend | None:
    """Point a job's ``model`` at its backend (:func:`rollout_config`; None: rollouts stay
    in the job); ValueError naming the key for a bad config, or for a spec that points a
    family without a remote path there (the tiny family rolls out in the job only; pointed
    there by the deployment's environment, it does so with a warning)."""
    config = rollout_config(raw, environ)
    if config is None:
        return None
    backend = RemoteBackend.from_config(config, environ)
    use = getattr(model, "use_remote", None)
    family = getattr(model, "family", type(model).__name__)
    if not callable(use) and raw is None:  # the deployment's server, for the families it serves
        logger.warning("the %s family rolls out in the job, not on %s", family, backend.url)
        return None
    if not callable(use):
        raise ValueError(
            f"rollout_backend: the {family} family rolls out in the job only (the remote "
            "backend is for hf models, which vLLM serves)"
        )
    use(backend, checkpoint=checkpoint)
    return backend
