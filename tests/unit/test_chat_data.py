"""The offline chat corpus ``shakespeare-chat`` (hf_fedshard/tools/data.py) and the SmolLM2 training template that
gives its assistant-only loss (recipes/chat_templates/): the conversations' shape, and the template's rendering."""

from __future__ import annotations

from pathlib import Path

from transformers.utils.chat_template_utils import render_jinja_template

from hf_fedshard.tools.data import conversations, shakespeare_chat

TRAINING_TEMPLATE = Path(__file__).parents[2] / "recipes" / "chat_templates" / "smollm2_training.jinja"
# SmolLM2-135M-Instruct's own template, as its GGUF (and the Hub model) ships it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PLAY = """ACT I.

Scene I. Elsinore. A platform before the Castle.

[Francisco at his post. Enter to him Bernardo.]

Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.

Ber.
Long live the king!

[Enter Horatio and Marcellus.]

Fran.
Bernardo?

MRS. PAGE.
He. [Aside.] Nothing more;
the rest is silence.

Scene II. A room of state in the Castle.

KING.
Though yet of Hamlet our dear brother's death

QUEEN.
Good Hamlet, cast thy nighted colour off,
And let thine eye look like a friend on Denmark.
"""


def test_speeches_become_turns_that_alternate_within_a_scene():
    chats = conversations(PLAY, turns=2)
    assert [[m["content"] for m in chat] for chat in chats] == [
        ["Who's there?", "Nay, answer me: stand, and unfold yourself."],
        ["Long live the king!", "Bernardo?"],  # stage directions between speeches are skipped
        # "He. ...", the scene's fifth speech, has no reply in its scene: left out, never paired with the next scene's
        [
            "Though yet of Hamlet our dear brother's death",
            "Good Hamlet, cast thy nighted colour off,\nAnd let thine eye look like a friend on Denmark.",
        ],
    ]
    assert all([m["role"] for m in chat] == ["user", "assistant"] for chat in chats)
    assert conversations(PLAY, turns=4)[0][-1]["content"] == "Bernardo?"
    assert conversations(PLAY, turns=1)[4][0]["content"] == "He. Nothing more;\nthe rest is silence."  # [Aside.] out


def test_the_corpus_holds_out_whole_plays_and_alternates_roles():
    data = shakespeare_chat()
    assert (len(data["train"]), len(data["validation"])) == (6604, 753)
    assert data["validation"][0]["messages"][0] == {"role": "user", "content": "Who's there?"}  # Hamlet opens it
    for split in data.values():
        for chat in split["messages"]:
            assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
            assert all(m["content"] and m["content"] == m["content"].strip() for m in chat)
    assert shakespeare_chat()["train"][1234] == data["train"][1234]  # deterministic


def render(template: str, chat: list[dict], **kwargs) -> tuple[str, list]:
    rendered, marks = render_jinja_template(conversations=[chat], chat_template=template, **kwargs)
    return rendered[0], (marks or [[]])[0]


def test_the_training_template_renders_as_smollm2s_and_marks_the_assistant_turns():
    template = TRAINING_TEMPLATE.read_text()
    chat = shakespeare_chat()["validation"][0]["messages"]
    system = [{"role": "system", "content": "Be brief."}, *chat[:2]]
    for messages in (chat, chat[:1], system):
        for prompt in (False, True):
            ours = render(template, messages, add_generation_prompt=prompt)[0]
            assert ours == render(SMOLLM2_TEMPLATE, messages, add_generation_prompt=prompt)[0]
    text, marks = render(template, chat, return_assistant_tokens_mask=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.count("<|im_start|>") == 5 and text.count("<|im_end|>") == 5
    # The loss reads each assistant reply and its <|im_end|> (the model learns to stop), nothing else.
    assert [text[start:end] for start, end in marks] == [f"{m['content']}<|im_end|>" for m in chat[1::2]]
