"""Chat templates (batchmaker/serving/chat_template.py): the prompt text and token ids equal
transformers' `apply_chat_template` for the same template and messages; where a template comes
from; the template's own refusals and the sandbox are clear errors."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")
from batchmaker.serving.chat_template import ChatTemplateError, load_chat_template  # noqa: E402
from batchmaker.serving.openai_api import ApiError, parse_request  # noqa: E402
from batchmaker.serving.text_model import TextModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from tiny_checkpoint import CHAT_TEMPLATE, train_tokenizer  # noqa: E402

# Llama-2-like: a system prompt folded into the first turn, loop controls, a namespace, tojson,
# slicing, the generation tag, eos_token
LLAMA_LIKE = """{% set ns = namespace(system='', turn=0) %}
{% if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% set rest = messages[1:] %}
{% else %}{% set rest = messages %}{% endif %}
{% for message in rest %}
    {% if message['role'] == 'note' %}{% continue %}{% endif %}
    {% set ns.turn = ns.turn + 1 %}
{% if (message['role'] == 'user') != (ns.turn % 2 == 1) %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}
{% if message['role'] == 'user' %}{{ bos_token }}[INST] {% if loop.first and ns.system %}<<SYS>>{{ ns.system }}<</SYS>> {% endif %}{{ message['content'] | trim }} [/INST]
{% else %}{% generation %} {{ message['content'] | trim }} {{ eos_token }}{% endgeneration %}
{% endif %}
{% if message.get('meta') %}{{ message['meta'] | tojson }}{% endif %}
{% endfor %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is cellular batching?"}],
    [{"role": "system", "content": "Réponds en français <s>"}, {"role": "user", "content": "  Bonjour 🙂 "},
     {"role": "assistant", "content": "Salut"}, {"role": "user", "content": "Et après ?", "meta": {"ü": "<&>"}}],
    [{"role": "user", "content": "a"}, {"role": "note", "content": "skipped"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A directory with tokenizer.json and a tokenizer_config.json holding the ChatML-like template."""
    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer().save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def text_model(path, template_file=None) -> TextModel:
    from tokenizers import Tokenizer

    return TextModel("tiny", Tokenizer.from_file(str(path / "tokenizer.json")), load_chat_template(path, template_file),
                     max_positions=256, vocab_size=480, eos_ids=(2,), created=0)


@pytest.mark.parametrize("messages", CONVERSATIONS[:3])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_checkpoints_template_renders_as_transformers_does(checkpoint, messages, add_generation_prompt):
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert load_chat_template(checkpoint).render(messages, add_generation_prompt) == want


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_an_override_template_renders_as_transformers_does(checkpoint, tmp_path, messages):
    (tmp_path / "llama.jinja").write_text(LLAMA_LIKE)
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    want = hf.apply_chat_template(messages, chat_template=LLAMA_LIKE, tokenize=False, add_generation_prompt=True)
    assert load_chat_template(checkpoint, tmp_path / "llama.jinja").render(messages) == want
    assert "<<SYS>>" in want or messages[0]["role"] != "system"


@pytest.mark.parametrize("messages", CONVERSATIONS[:3])
def test_the_chat_prompts_token_ids_are_transformers_ids(checkpoint, messages):
    messages = [{k: v for k, v in m.items() if k != "meta"} for m in messages]  # (the API takes role, content, name)
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    models = {"tiny": text_model(checkpoint)}
    request = parse_request("chat.completion", {"model": "tiny", "messages": messages}, models, set())
    assert list(request.prompts[0]) == list(want)


def test_where_the_template_comes_from(checkpoint, tmp_path):
    assert load_chat_template(checkpoint).special_tokens == {"bos_token": "<s>", "eos_token": "</s>",
                                                             "unk_token": "<unk>"}
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert load_chat_template(plain) is None  # chat requests to such a model are refused (below)
    (plain / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "</s>", "lstrip": False}}))
    (plain / "chat_template.jinja").write_text("{{ bos_token }}{{ eos_token }}")
    assert load_chat_template(plain).render([]) == "<s></s>"  # (an AddedToken's content, from the map)
    (plain / "chat_template.jinja").unlink()
    (plain / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_chat_template(plain).render([]) == "D"
    (plain / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template(plain).render([{"role": "user", "content": "x"}]) == "J1"
    assert load_chat_template(None) is None


def test_a_model_without_a_template_refuses_chat(tmp_path):
    from tokenizers import Tokenizer

    model = TextModel("tiny", Tokenizer.from_str(train_tokenizer().to_str()), None, 256, 480, (2,), 0)
    with pytest.raises(ApiError, match="no chat template") as caught:
        parse_request("chat.completion", {"model": "tiny", "messages": CONVERSATIONS[0]}, {"tiny": model}, set())
    assert caught.value.status == 400 and caught.value.param == "messages"


def test_raise_exception_and_the_sandbox_are_chat_template_errors(checkpoint):
    template = load_chat_template(checkpoint)
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        template.render([{"role": "robot", "content": "beep"}])
    escapes = ["{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__base__.__subclasses__() }}",
               "{{ messages.append(1) }}", "{{ messages[0].update({'role': 'system'}) }}"]
    for source in escapes:
        from batchmaker.serving.chat_template import ChatTemplate

        with pytest.raises(ChatTemplateError):
            ChatTemplate(source).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
