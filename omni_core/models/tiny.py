"""Built-in tiny models: random weights and a locally trained tokenizer, built offline.

Three are built in: `tiny://lm` (below), `tiny://qwen3-omni` (`omni_core.models.tiny_omni`) and
`tiny://sd3` (`omni_core.models.tiny_sd3`). This module holds what they share: the recipe digest,
byte-level BPE training, seeded weight init and the atomic on-disk cache.

`tiny://lm` is transformers' Qwen3 causal LM at toy size (hidden 64, 2 layers, 4 heads, 2 kv heads,
tied embeddings, float32) with a byte-level BPE tokenizer trained on the fixed corpus below
(English word problems, digits, `####`, chat and `<think>/<answer>` markup). Nothing is downloaded.

The build is deterministic: the same recipe gives byte-identical `model.safetensors` and tokenizer
files. A built model lives in `$OMNI_CACHE_DIR` (default `~/.cache/omni`) under
`tiny/<name>-<digest of the recipe>/`; it is built in a temporary directory and renamed into place,
so concurrent processes never see a half-built directory.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omni_core.errors import ModelError

RECIPE_VERSION = 2  # bump when the build code changes in a way the recipe dict does not capture

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2

# ChatML, as Qwen uses: each message is `<|im_start|>{role}\n{content}<|im_end|>\n`.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split: words, single digits, punctuation runs, whitespace.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'

# Fixed training corpus for the tokenizer (original text in the style of GSM8K and MMK12 rows).
_CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?" + _SUFFIX,
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
    "altogether in April and May.\n#### 72",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?" + _SUFFIX,
    "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
    "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she "
    "needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much "
    "as her parents. How much more money does Betty need to buy the wallet?" + _SUFFIX,
    "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her "
    "15 * 2 = $<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 "
    "more.\n#### 5",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he "
    "write a year?" + _SUFFIX,
    "He writes each friend 3*2=<<3*2=6>>6 pages a week\nSo he writes 6*2=<<6*2=12>>12 pages every "
    "week\nThat means he writes 12*52=<<12*52=624>>624 pages a year\n#### 624",
    "A store has 1,250 apples. It sells 375 apples on Monday and 420 apples on Tuesday. "
    "How many apples are left?" + _SUFFIX,
    "The store sold 375 + 420 = <<375+420=795>>795 apples.\nThere are 1,250 - 795 = "
    "<<1250-795=455>>455 apples left.\n#### 455",
    "The temperature was 7 degrees in the morning and fell by 12 degrees at night. What was the "
    "temperature at night?" + _SUFFIX,
    "The temperature at night was 7 - 12 = <<7-12=-5>>-5 degrees.\n#### -5",
    "Tom has three boxes with 16 pencils each. He gives 9 pencils to his sister and buys 4 more. "
    "How many pencils does Tom have now?" + _SUFFIX,
    "Tom had 3 * 16 = <<3*16=48>>48 pencils.\nAfter giving 9 away he had 48 - 9 = <<48-9=39>>39.\n"
    "Then he has 39 + 4 = <<39+4=43>>43 pencils.\n#### 43",
    "A train travels 60 miles per hour for 2.5 hours. How far does the train travel?" + _SUFFIX,
    "The train travels 60 * 2.5 = <<60*2.5=150>>150 miles.\n#### 150",
    "Maria bought 6 books for $8 each and a pen for $3. She paid with a $100 bill. How much change "
    "did she get?" + _SUFFIX,
    "The books cost 6 * 8 = $<<6*8=48>>48.\nShe spent 48 + 3 = $<<48+3=51>>51 in total.\n"
    "Her change was 100 - 51 = $<<100-51=49>>49.\n#### 49",
    "There are 30 students in a class. Two fifths of them are boys. How many girls are in the "
    "class?" + _SUFFIX,
    "There are 30 * 2 / 5 = <<30*2/5=12>>12 boys.\nSo there are 30 - 12 = <<30-12=18>>18 girls.\n#### 18",
    "A farmer has 24 cows and 3 times as many chickens. Each week he sells 10 chickens. How many "
    "weeks until he has no chickens left?" + _SUFFIX,
    "He has 24 * 3 = <<24*3=72>>72 chickens.\nIt takes 72 / 10 = 7.2, so 8 weeks.\n#### 8",
    "John runs 5 kilometers every day for 14 days, then 7 kilometers a day for 10 days. What is the "
    "total distance he runs?" + _SUFFIX,
    "First he runs 5 * 14 = <<5*14=70>>70 km.\nThen he runs 7 * 10 = <<7*10=70>>70 km.\n"
    "In total he runs 70 + 70 = <<70+70=140>>140 km.\n#### 140",
    "A baker makes 144 cookies and puts them into bags of 12. She sells each bag for $4.50. How "
    "much money does she make?" + _SUFFIX,
    "She fills 144 / 12 = <<144/12=12>>12 bags.\nShe makes 12 * 4.50 = $<<12*4.5=54>>54.\n#### 54",
    "The price of a shirt is $40. It is on sale for 25% off. What is the sale price?" + _SUFFIX,
    "The discount is 40 * 25 / 100 = $<<40*25/100=10>>10.\nThe sale price is 40 - 10 = "
    "$<<40-10=30>>30.\n#### 30",
    "Sam is 8 years older than his brother. In 4 years the sum of their ages will be 36. How old "
    "is Sam now?" + _SUFFIX,
    "In 4 years the sum grows by 8, so now it is 36 - 8 = 28.\nHis brother is (28 - 8) / 2 = "
    "<<(28-8)/2=10>>10.\nSam is 10 + 8 = <<10+8=18>>18 years old.\n#### 18",
    "<think>\nThe question asks for the area of the rectangle. The width is 9 and the length is "
    "11, so the area is 9 * 11 = 99.\n</think>\n<answer>\\boxed{99}</answer>",
    "<image>\nLook at the figure and answer the question. Which option is correct?\n"
    "A. 12\nB. 15\nC. 18\nD. 21\nE. 24",
    "<think>\nThe angle sum of a triangle is 180 degrees, so the third angle is 180 - 50 - 60 = 70."
    "\n</think>\n<answer>\\boxed{C}</answer>",
    "What is the value of x if 3x + 5 = 20? Please reason step by step, and put your final answer "
    "within \\boxed{}.",
    "0 1 2 3 4 5 6 7 8 9 10 20 30 40 50 60 70 80 90 100 1,000 10,000 0.5 0.25 -1 -2 -10 3/4 50%",
    "The quick brown fox jumps over the lazy dog! Is it true? Yes; it is: (a) true, (b) false. "
    "\"Quoted\" text, 'single quotes', and [brackets] {braces} + - * / = < > % & @ # $ ^ _ ~ |",
]

# Frequent words of grade-school word problems and chat markup, so prompts tokenize compactly.
_WORDS = """
the a an and or but if then so because of to in on at by for with from into over under after before
between each every per than as is are was were be been being has have had do does did will would can
could should may might must shall not no yes all some any many much more most less least few several
both half twice three times once how what which who whom whose when where why there here this that
these those it its he she they we you i me him her them us our your their his hers my mine
one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen
seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand
million first second third fourth fifth last next other another same different total sum difference
product quotient remainder number numbers amount value price cost costs costed pay pays paid spend
spends spent earn earns earned save saves saved buy buys bought sell sells sold sale discount profit
money dollar dollars cent cents bill bills change tax tip interest rate percent percentage fraction
hour hours minute minutes second seconds day days week weeks month months year years morning
afternoon evening night today yesterday tomorrow daily weekly monthly yearly time times long longer
mile miles kilometer kilometers meter meters foot feet inch inches yard yards pound pounds ounce
ounces gram grams kilogram kilograms liter liters gallon gallons cup cups speed distance height
weight length width area perimeter volume average mean ratio rectangle square circle triangle
apple apples orange oranges banana bananas egg eggs cookie cookies cake cakes pie pies candy candies
pizza slices slice bread muffin muffins sandwich sandwiches fruit fruits vegetable vegetables milk
water juice book books page pages pencil pencils pen pens paper box boxes bag bags basket baskets
jar jars bottle bottles toy toys ball balls game games card cards sticker stickers marble marbles
flower flowers tree trees garden farm farmer farmers market store shop bakery school class classroom
student students teacher teachers friend friends family mother father mom dad brother sister son
daughter parents grandparents child children kid kids boy boys girl girls man men woman women people
person team player players dog dogs cat cats chicken chickens cow cows horse horses duck ducks fish
bird birds animal animals car cars bus train bike truck house room rooms floor wall walls window
road trip ticket tickets movie party gift gifts shirt shirts shoes dress hat job work works worked
working hourly salary wage wages plan plans need needs needed want wants wanted make makes
made take takes took give gives gave get gets got have keep keeps kept put puts find finds found
read reads write writes wrote run runs ran walk walks walked drive drives drove eat eats ate drink
drinks fill fills filled share shares shared split splits divide divides divided multiply add adds
added subtract left remain remains remaining rest altogether together each equally increase increased
decrease decreased double triple grow grows grew fell fall rise rose more fewer extra full empty
new old young older younger big small large larger smaller tall short fast slow high low early late
answer answers question questions problem problems step steps think thinking reason reasoning final
output solve solution calculate compute find therefore thus since means first then finally let let's
user assistant system image audio video option options correct choose which following figure shown
How What If She He They The There Each Every In A An After Then So This That It His Her
"""


def lm_corpus() -> list[str]:
    """The tokenizer corpus of tiny://lm (the other tiny models extend it)."""
    words = " ".join(_WORDS.split())
    chat = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<|im_end|>"
    return [*_CORPUS, words, words, chat, chat]


def digest(obj: object) -> str:
    """A 12-hex-digit digest of a JSON-serialisable object (key order does not matter)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _lm_recipe(seed: int) -> dict:
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "tokenizer": byte_bpe_spec(lm_corpus(), SPECIAL_TOKENS, split_pattern=_SPLIT_PATTERN,
                                   chat_template=CHAT_TEMPLATE),
        "model": {
            "architecture": "Qwen3ForCausalLM",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
            "dtype": "float32",
        },
    }


def byte_bpe_spec(corpus: list[str], special_tokens: list[str], **extra: Any) -> dict:
    """The `tokenizer` entry of a tiny model's recipe (what `byte_bpe_tokenizer` reads, plus the
    corpus digest and the model's `extra` keys, so that any change names a new build)."""
    return {"kind": "byte-level-bpe", "vocab_size": 2048, "min_frequency": 2, "special_tokens": special_tokens,
            **extra, "corpus_sha256": hashlib.sha256("\n".join(corpus).encode()).hexdigest()}


def byte_bpe_tokenizer(corpus: list[str], spec: dict, *, wrap: tuple[str, str] | None = None, **fast: Any):
    """The tokenizer of every tiny model: a byte-level BPE trained on `corpus` with the recipe's
    `spec` (`vocab_size`, `min_frequency`, `special_tokens`), as a `PreTrainedTokenizerFast` made with
    `fast` (its special tokens, chat template, padding side, max length). `wrap=(bos, eos)` adds
    `bos ... eos` around every encoded text (CLIP's style)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = train_byte_bpe(corpus, vocab_size=spec["vocab_size"], min_frequency=spec["min_frequency"],
                         special_tokens=spec["special_tokens"])
    if wrap is not None:
        bos, eos = wrap
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A {eos}", special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tok, **fast)


def train_byte_bpe(corpus: list[str], *, vocab_size: int, min_frequency: int, special_tokens: list[str]):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus` (Qwen2's pre-tokenizer split).

    `special_tokens` get ids 0, 1, 2, ... in order. Deterministic: same inputs, same vocab and merges.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _build_tokenizer(recipe: dict):
    spec = recipe["tokenizer"]
    return byte_bpe_tokenizer(lm_corpus(), spec, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                              chat_template=spec["chat_template"], padding_side="left",
                              model_max_length=recipe["model"]["max_position_embeddings"])


def _build_model(recipe: dict, tokenizer):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    spec = {k: v for k, v in recipe["model"].items() if k not in ("architecture", "dtype")}
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config = Qwen3Config(vocab_size=len(tokenizer), dtype=recipe["model"]["dtype"], **spec, **ids)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        model = Qwen3ForCausalLM(config).to(torch.float32)
    seeded_init_(model, recipe["seed"], config.initializer_range)
    model.generation_config = GenerationConfig(**ids)
    return model


@torch.no_grad()
def seeded_init_(model: torch.nn.Module, seed: int, std: float) -> None:
    """Norm weights 1, biases 0, every other parameter N(0, std) from its own generator seeded by
    (seed, parameter name).

    Independent of the libraries' own init code and of the global RNG, so builds are reproducible
    across versions and safe in concurrent threads. A norm is any module whose class name contains
    "Norm" (LayerNorm, RMSNorm, GroupNorm, ...); only its own parameters count, not its children's.
    """
    norm_params = {
        f"{prefix}.{pname}" if prefix else pname
        for prefix, module in model.named_modules()
        if "Norm" in type(module).__name__
        for pname, _ in module.named_parameters(recurse=False)
    }
    for name, param in model.named_parameters():  # a tied weight is listed once
        if name in norm_params:
            param.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            gen = torch.Generator().manual_seed(int(digest([seed, name]), 16))
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


NOT_DOWNLOADED = "Nothing was downloaded; building again gives byte-identical files."


def model_card(name: str, intro: str, facts: list[str], recipe: dict) -> str:
    """A tiny model's README.md: its URI as title, `intro`, one bullet per fact, the recipe as JSON."""
    bullets = "".join(f"- {fact}\n" for fact in facts)
    recipe_json = json.dumps(recipe, indent=2, sort_keys=True)
    return f"# tiny://{name}\n\n{intro}\n\n{bullets}\n## Recipe\n\n```json\n{recipe_json}\n```\n"


def toy_model_intro(module: str) -> str:
    return (f"A toy model built locally by `{module}` for tests and CPU pipelines.\n"
            "**Random weights, not a trained model**: its outputs are meaningless until trained.")


def _model_card(name: str, recipe: dict, vocab_size: int) -> str:
    m = recipe["model"]
    return model_card(name, toy_model_intro("omni_core.models.tiny"), [
        f"Architecture: {m['architecture']} (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
        f"{m['num_attention_heads']} heads, {m['num_key_value_heads']} kv heads, tied embeddings, "
        f"{m['dtype']}), initialised with seed {recipe['seed']}.",
        f"Tokenizer: byte-level BPE trained on a small built-in corpus, vocab {vocab_size}; "
        f"pad `{PAD_TOKEN}`, bos `{BOS_TOKEN}`, eos `{EOS_TOKEN}`; ChatML chat template.",
        NOT_DOWNLOADED,
    ], recipe)


def _build_lm(name: str, recipe: dict, out: Path) -> None:
    tokenizer = _build_tokenizer(recipe)
    model = _build_model(recipe, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(_model_card(name, recipe, len(tokenizer)))


Recipe = Callable[[int], dict]
Builder = Callable[[str, dict, Path], None]

# name -> (recipe for a seed, builder writing the model into a directory)
TINY_MODELS: dict[str, tuple[Recipe, Builder]] = {
    "lm": (_lm_recipe, _build_lm),
}
# name -> module defining `recipe(seed)` and `build(name, recipe, out)`, imported on first use
_LAZY_TINY_MODELS = {
    "qwen3-omni": "omni_core.models.tiny_omni",
    "sd3": "omni_core.models.tiny_sd3",
}


def tiny_model_names() -> list[str]:
    """The names `tiny://<name>` accepts."""
    return sorted({*TINY_MODELS, *_LAZY_TINY_MODELS})


def _recipe_and_builder(name: str) -> tuple[Recipe, Builder]:
    if name in TINY_MODELS:
        return TINY_MODELS[name]
    if name in _LAZY_TINY_MODELS:
        module = importlib.import_module(_LAZY_TINY_MODELS[name])
        return module.recipe, module.build
    raise ModelError(
        f"unknown built-in model 'tiny://{name}': known ones are "
        + ", ".join(f"tiny://{n}" for n in tiny_model_names())
    )


def cache_root() -> Path:
    """`$OMNI_CACHE_DIR`, or `~/.cache/omni` when it is unset."""
    return Path(os.environ.get("OMNI_CACHE_DIR") or Path.home() / ".cache" / "omni").expanduser()


def tiny_model_built(name: str = "lm", *, seed: int = 0, cache_dir: str | Path | None = None) -> Path | None:
    """The directory of built-in tiny model `name` if it is built already, else None (nothing is built)."""
    make_recipe, _ = _recipe_and_builder(name)
    root = (Path(cache_dir) if cache_dir is not None else cache_root()) / "tiny"
    final = root / f"{name}-{digest(make_recipe(seed))}"
    return final if final.is_dir() else None


def tiny_model_dir(name: str = "lm", *, seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of built-in tiny model `name`, building it on first use.

    The directory is `<cache>/tiny/<name>-<recipe digest>/`: a `save_pretrained` directory (for
    `tiny://sd3`, one folder per component), which `omni_core.models.load_model` loads.
    """
    make_recipe, build = _recipe_and_builder(name)
    recipe = make_recipe(seed)
    root = (Path(cache_dir) if cache_dir is not None else cache_root()) / "tiny"
    final = root / f"{name}-{digest(recipe)}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        build(name, recipe, tmp)
        try:
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
