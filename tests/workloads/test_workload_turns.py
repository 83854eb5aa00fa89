"""Token-exact turns: an environment turn is appended to the engine's ids as the chat template renders it,
and the model's turns are never re-tokenized (detokenize + re-render is the trap: it changes ids)."""

from __future__ import annotations

import pathlib

from transformers import AutoTokenizer

from fleetrl.config import ModelConfig
from fleetrl.rollout.episodes import TurnTemplate
from fleetrl.rollout.tokenize import load_codec

MESSAGES = [{"role": "user", "content": "Say a colour."}]
OBS = [{"role": "tool", "content": "<result>blue</result>"}]


def test_environment_turn_matches_the_template_and_keeps_the_engine_s_ids(qwen2_folder: pathlib.Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen2_folder), local_files_only=True)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    codec = load_codec(ModelConfig(path=str(qwen2_folder)), [im_end])
    template = TurnTemplate(codec, [im_end])
    prompt = codec.render(MESSAGES)

    def rerender(text: str) -> list[int]:
        chat = [*MESSAGES, {"role": "assistant", "content": text}, *OBS]
        return [int(i) for i in tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)]

    # A turn the engine wrote the canonical way: ours is exactly the full conversation rendered.
    canonical = [*tok("red", add_special_tokens=False)["input_ids"], im_end]
    ours = prompt + canonical + template.observation_ids(OBS, stopped=True)
    assert ours == rerender("red")
    # The same turn cut at the token budget (no end token): the template's end token is added for it.
    cut = canonical[:-1]
    assert prompt + cut + template.observation_ids(OBS, stopped=False) == rerender("red")

    # A turn sampled as single letters (a model may): re-rendering would merge them into one token.
    letters = [*(tok.convert_tokens_to_ids(c) for c in "red"), im_end]
    assert letters != canonical
    ours = prompt + letters + template.observation_ids(OBS, stopped=True)
    assert ours[len(prompt):len(prompt) + len(letters)] == letters  # the engine's ids, kept
    assert ours != rerender("red")  # what detokenize + re-render would have trained on instead
    assert tok.decode(ours) == tok.decode(rerender("red"))  # the same text either way
