"""The multi-turn episode driver: many episodes in flight, one trajectory per episode.

    for each request:  env = env_class(runtime); env.reset(row, episode_seed(seed, sample_id))
    until every episode has ended:
        one engine call for every episode waiting for the model (each gets one turn)
        each environment steps in a thread (tools run meanwhile, in the tool sandbox)
        the observation is appended with loss mask 0, or the episode ends

Turn ``k`` of sample ``s`` is generated as request ``s`` (k = 0) or ``s#t<k>``, from
``prompt + response so far``: the engine's per-sample seeding makes a rerun of the same
requests replay the same trajectories (with deterministic tools and no budget hit), whatever
the batching. Every turn re-prefills its context; SGLang's radix cache reuses the shared
prefix, the transformers engine recomputes it (cheap at CPU sizes; KV reuse across turns is
a later optimisation).

A turn ends at the end-of-turn token, at a stop string (``params.stop`` plus the
environment's, e.g. ``</tool_call>``) or at its token limit. Budgets per episode
(``EpisodeBudget``): turns, response tokens (model + observation; a turn may generate at
most what is left, and an observation that would leave no room ends the episode), and wall
time (checked between turns and while a step runs; a step past it is abandoned, its
result dropped). The engine is never idle for a slow tool: episodes whose step is done go
to the next engine call while others still wait; steps that finish within ``gather_s`` of
the first join the same call.

Images across turns (a vision model's runner, built with its ``MediaProcessor``): an
observation may carry images (``Observation.images``, one per ``{"type": "image"}`` part).
Its markup is rendered by the chat template and each pad expanded once per embedding of its
image, so the observation tokens (loss mask 0) hold every image token; the images join the
episode's media after the prompt's. Every turn's request sends all of them, in order, as
``multimodal``, and the trajectory's ``media`` is the same list (the prompt's own payload
object when no observation added one), so the trainer rebuilds the same inputs.

Must not: score outside the environment, write the spool, or import the trainer.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any

from relax_hpc.media.payload import MediaPayload
from relax_hpc.media.processor import MediaProcessor, content_parts, media_part_counts
from relax_hpc.models.chat_format import ChatFormat
from relax_hpc.rollout.engines.base import Completion, Engine, GenerationRequest, SamplingParams
from relax_hpc.rollout.envs.base import Action, EnvRuntime, StepResult, episode_seed
from relax_hpc.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeBudget:
    max_turns: int = 4
    max_response_tokens: int = 256  # model + observation tokens after the prompt
    max_wall_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_response_tokens < 1 or self.max_wall_s <= 0:
            raise ValueError(
                "episode budget: max_turns and max_response_tokens must be >= 1 and "
                f"max_wall_s > 0, got {self}"
            )


@dataclass(frozen=True)
class EpisodeRequest:
    sample_id: str  # unique per sample of the run; seeds the engine and the environment
    prompt_ids: list[int]
    row: Mapping[str, Any]  # the dataset row: prompt, answer and its other columns
    media: MediaPayload | None = None  # the prompt's fitted media (shared by its group)


def turn_sample_id(sample_id: str, turn: int) -> str:
    """The engine request id of a turn: the sample's own id for the first turn."""
    return sample_id if turn == 0 else f"{sample_id}#t{turn}"


class _Episode:
    def __init__(self, request: EpisodeRequest, started_s: float) -> None:
        self.request = request
        self.trajectory = Trajectory(
            request.sample_id, list(request.prompt_ids), media=request.media
        )
        self.started_s = started_s
        self.env: Any = None
        self.waiting_for = "model"  # "model", "env" (a step in flight) or "" (ended)
        self.end_of_turn_text: str | None = None

    def context_ids(self) -> list[int]:
        return self.trajectory.prompt_ids + self.trajectory.response_ids

    def multimodal(self) -> dict[str, list[Any]] | None:
        """The engine request's media: every image of the context so far, in order."""
        media = self.trajectory.media
        if media is None or media.is_empty:
            return None
        return {"image": list(media.images), "audio": list(media.audio)}


class EpisodeRunner:
    """Runs batches of episodes of one environment class; ``close()`` when done with it."""

    def __init__(
        self,
        engine: Engine,
        chat: ChatFormat,
        env_class: type,
        runtime: EnvRuntime,
        budget: EpisodeBudget,
        seed: int,
        step_threads: int = 32,
        gather_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
        media_processor: MediaProcessor | None = None,
    ) -> None:
        self.engine = engine
        self.media_processor = media_processor  # a vision model's: images in observations
        self.chat = chat
        self.env_class = env_class
        self.runtime = runtime
        self.budget = budget
        self.seed = seed
        self.gather_s = gather_s
        self.clock = clock
        self._pool = ThreadPoolExecutor(step_threads, thread_name_prefix="env-step")

    def close(self) -> None:
        # Abandoned steps (wall budget) may still run; they hold a thread, not the caller.
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self, requests: Sequence[EpisodeRequest], params: SamplingParams) -> list[Trajectory]:
        """One trajectory per request, in request order."""
        episodes = [self._start(request) for request in requests]
        pending: dict[Future, _Episode] = {}
        try:
            while True:
                self._expire(episodes, pending)
                waiting = [e for e in episodes if e.waiting_for == "model"]
                self._collect(pending, block=not waiting)
                waiting = [e for e in episodes if e.waiting_for == "model"]
                if waiting:
                    self._generate_turn(waiting, params, pending)
                elif not pending:
                    break
        finally:
            for episode in episodes:
                self._close_env(episode)
        return [e.trajectory for e in episodes]

    # --- phases ------------------------------------------------------------------------------
    def _start(self, request: EpisodeRequest) -> _Episode:
        episode = _Episode(request, self.clock())
        try:
            episode.env = self.env_class(self.runtime)
            first = episode.env.reset(request.row, episode_seed(self.seed, request.sample_id))
            if first is not None and first.images:
                self._media_prompt(episode, first)
            elif first is not None and first.messages:
                episode.trajectory.prompt_ids = self.chat.prompt_ids(first.messages, first.tools)
        except Exception as error:  # a broken environment ends its episode, not the rollout
            self._fail(episode, "reset", error)
        return episode

    def _generate_turn(
        self, episodes: list[_Episode], params: SamplingParams, pending: dict[Future, _Episode]
    ) -> None:
        """One engine call per (token limit, stop strings); then each environment steps."""
        batches: dict[tuple[int, tuple[str, ...]], list[_Episode]] = defaultdict(list)
        for episode in episodes:
            left = self.budget.max_response_tokens - len(episode.trajectory.response_ids)
            stops = tuple(dict.fromkeys((*params.stop, *getattr(episode.env, "stop", ()))))
            batches[(min(params.max_new_tokens, left), stops)].append(episode)
        for (max_new_tokens, stops), batch in batches.items():
            turn_params = replace(params, max_new_tokens=max_new_tokens, stop=stops)
            requests = [
                GenerationRequest(
                    turn_sample_id(e.request.sample_id, e.trajectory.num_turns),
                    e.context_ids(),
                    e.multimodal(),
                )
                for e in batch
            ]
            completions = self.engine.generate(requests, turn_params)
            for episode, completion in zip(batch, completions, strict=True):
                action = self._record_turn(episode, completion)
                pending[self._pool.submit(_step, episode.env, action)] = episode

    def _record_turn(self, episode: _Episode, completion: Completion) -> Action:
        trajectory = episode.trajectory
        turn = trajectory.num_turns
        trajectory.add_model_turn(
            list(completion.token_ids),
            list(completion.logprobs),
            completion.finish_reason,
            completion.policy_version,
        )
        ended_by_token = completion.finish_reason == "stop" and completion.stop is None
        episode.end_of_turn_text = (
            self.chat.tokenizer.decode(completion.token_ids[-1:], skip_special_tokens=False)
            if ended_by_token and completion.token_ids
            else None
        )
        episode.waiting_for = "env"
        return Action(
            completion.text,
            tuple(completion.token_ids),
            completion.finish_reason,
            completion.stop,
            turn,
        )

    def _collect(self, pending: dict[Future, _Episode], block: bool) -> None:
        """Apply finished steps; with ``block``, first wait for one (or the next deadline)."""
        if not pending:
            return
        if block:
            timeout = max(self._next_deadline(pending.values()) - self.clock(), 0.0)
            done, _ = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            if done:  # steps of the same wave that finish just after join the next call
                wait(pending, timeout=self.gather_s)
        for future in [f for f in pending if f.done()]:
            self._apply(pending.pop(future), future.result())

    def _apply(self, episode: _Episode, outcome: StepResult | Exception) -> None:
        if isinstance(outcome, Exception):
            self._fail(episode, "step", outcome)
            return
        trajectory = episode.trajectory
        reward = float(outcome.reward)
        if not math.isfinite(reward):
            self._fail(episode, "step", ValueError(f"non-finite reward {outcome.reward}"))
            return
        trajectory.reward += reward
        trajectory.info.update(outcome.info)
        trajectory.turns[-1].tool_statuses = [r.status for r in outcome.tool_results]
        trajectory.tool_wall_s += sum(r.wall_s for r in outcome.tool_results)
        if outcome.done:
            self._end(episode, "done")
        elif trajectory.num_turns >= self.budget.max_turns:
            self._end(episode, "max_turns")
        else:
            try:
                observation, media = self._observation(episode, outcome.observation)
            except Exception as error:  # a message the template cannot render, a bad image
                self._fail(episode, "observation", error)
                return
            # An observation that leaves no room for a model token ends the episode.
            if len(trajectory.response_ids) + len(observation) >= self.budget.max_response_tokens:
                self._end(episode, "max_tokens")
            else:
                trajectory.add_observation(observation)
                trajectory.media = media
                episode.waiting_for = "model"

    def _observation(
        self, episode: _Episode, observation: Any
    ) -> tuple[list[int], MediaPayload | None]:
        """The observation's tokens, and the episode's media with its images appended."""
        media = episode.trajectory.media
        if not observation.images:
            ids = self.chat.observation_ids(observation.messages, episode.end_of_turn_text)
            return ids, media
        processor = self._processor()
        messages = _typed_messages(observation, episode.request.sample_id)
        text = self.chat.observation_text(messages, episode.end_of_turn_text, media_parts=True)
        where = f"{episode.request.sample_id} observation {episode.trajectory.num_turns}"
        added = processor.fit(observation.images, (), where)
        text = processor.expand(text, added, where)
        old = (media.images, media.audio) if media is not None else ((), ())
        merged = MediaPayload(
            (*old[0], *added.images), old[1], added.sampling_rate_hz, added.fingerprint
        )
        return self.chat.encode(text), merged

    def _media_prompt(self, episode: _Episode, first: Any) -> None:
        """A ``reset`` observation with images is the whole prompt, its images the media."""
        processed = self._processor().process(
            list(_typed_messages(first, episode.request.sample_id)),
            first.images,
            where=f"{episode.request.sample_id} reset",
        )
        episode.trajectory.prompt_ids = processed.prompt_ids
        episode.trajectory.media = processed.payload

    def _processor(self) -> MediaProcessor:
        if self.media_processor is None:
            raise ValueError(
                "the observation carries images, but the policy is a text model; images in "
                "observations need a vision model (model.modality=vision)"
            )
        return self.media_processor

    def _expire(self, episodes: list[_Episode], pending: dict[Future, _Episode]) -> None:
        """End episodes past their wall budget; their steps in flight are dropped."""
        now = self.clock()
        late = [e for e in episodes if e.waiting_for and now >= self._deadline(e)]
        for future in [f for f, e in pending.items() if e in late]:
            del pending[future]
        for episode in late:
            self._end(episode, "wall_time")

    # --- helpers -----------------------------------------------------------------------------
    def _deadline(self, episode: _Episode) -> float:
        return episode.started_s + self.budget.max_wall_s

    def _next_deadline(self, episodes: Any) -> float:
        return min(self._deadline(e) for e in episodes)

    def _end(self, episode: _Episode, reason: str) -> None:
        episode.waiting_for = ""
        episode.trajectory.end_reason = reason
        episode.trajectory.wall_s = self.clock() - episode.started_s

    def _fail(self, episode: _Episode, where: str, error: Exception) -> None:
        message = f"{where} raised {type(error).__name__}: {error}"
        log.warning("episode %s: environment %s", episode.request.sample_id, message)
        episode.trajectory.info["env_error"] = message
        self._end(episode, "env_error")

    def _close_env(self, episode: _Episode) -> None:
        if episode.env is None:
            return
        try:
            episode.env.close()
        except Exception as error:  # closing must not hide the trajectories
            log.warning("episode %s: environment close raised %r", episode.request.sample_id, error)


def _typed_messages(observation: Any, where: str) -> tuple[dict[str, Any], ...]:
    """Messages with typed part contents, one image part per image (else a ValueError)."""
    messages = tuple({**m, "content": content_parts(m["content"])} for m in observation.messages)
    num_image_parts = media_part_counts(list(messages))[0]
    if num_image_parts != len(observation.images):
        raise ValueError(
            f"{where}: the observation has {num_image_parts} image parts for "
            f"{len(observation.images)} images; give one {{'type': 'image'}} part per image"
        )
    return messages


def _step(env: Any, action: Action) -> StepResult | Exception:
    """Runs in a step thread; an exception is returned, not raised, so it is never lost."""
    try:
        return env.step(action)
    except Exception as error:
        return error
