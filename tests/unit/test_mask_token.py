import pytest
import torch

from deepspec.models.mask_token import check_mask_token_absent, choose_mask_token_id


class _Tok:
    """The parts of a Hugging Face tokenizer that the mask-token policy reads."""

    def __init__(self, vocab, pad=2, eos=2, bos=1, mask_token=None):
        self._vocab = vocab
        self.mask_token = mask_token
        self.pad_token_id, self.eos_token_id, self.bos_token_id = pad, eos, bos
        self.unk_token_id = None

    def __len__(self):
        return len(self._vocab)

    def get_vocab(self):
        return dict(self._vocab)

    def convert_tokens_to_ids(self, token):
        return self._vocab.get(token)


VOCAB = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<repo_name>": 3, "a": 4, "b": 5}


def test_spare_embedding_row_is_the_last_resort():
    no_reserved = {k: v for k, v in VOCAB.items() if k != "<repo_name>"}
    assert choose_mask_token_id(_Tok(no_reserved), num_embeddings=8) == 5
    assert choose_mask_token_id(_Tok(VOCAB), num_embeddings=8) == 3  # a reserved token comes first


def test_declared_mask_token_then_qwen_reserved_then_padding_only_tokens():
    gemma = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<mask>": 4, "<unused0>": 7, "a": 8}
    assert choose_mask_token_id(_Tok(gemma, pad=0, eos=1, bos=2, mask_token="<mask>"), num_embeddings=9) == 4
    assert choose_mask_token_id(_Tok(gemma, pad=0, eos=1, bos=2), num_embeddings=9) == 7  # padding-only
    # Qwen2.5 spells its reserved tokens with bars; the declared mask token still wins over them
    qwen = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|fim_pad|>": 3, "<|repo_name|>": 4,
            "<|file_sep|>": 5, "a": 6}
    assert choose_mask_token_id(_Tok(qwen, pad=0, eos=2), num_embeddings=7) == 4
    assert choose_mask_token_id(_Tok({k: v for k, v in qwen.items() if k != "<|repo_name|>"}, pad=0, eos=2),
                                num_embeddings=7) == 5
    assert choose_mask_token_id(_Tok(qwen, pad=0, eos=2, mask_token="<|fim_pad|>"), num_embeddings=7) == 3
    # a candidate that is the pad token is skipped, never chosen
    assert choose_mask_token_id(_Tok(qwen, pad=4, eos=2), num_embeddings=7) == 5
    llama3 = {"<|begin_of_text|>": 0, "<|eot_id|>": 1, "<|reserved_special_token_2|>": 3,
              "<|reserved_special_token_0|>": 2, "a": 4}
    assert choose_mask_token_id(_Tok(llama3, pad=None, eos=1, bos=0), num_embeddings=5) == 2


def test_reserved_token_used_when_no_spare_row():
    assert choose_mask_token_id(_Tok(VOCAB), num_embeddings=6) == 3


def test_pad_eos_and_out_of_range_are_refused():
    with pytest.raises(ValueError, match="pad_token_id"):
        choose_mask_token_id(_Tok(VOCAB), num_embeddings=6, requested="<|im_end|>")
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        choose_mask_token_id(_Tok(VOCAB), num_embeddings=6, requested=99)
    with pytest.raises(ValueError, match="not a token"):
        choose_mask_token_id(_Tok(VOCAB), num_embeddings=6, requested="<nope>")


def test_no_automatic_choice_says_how_to_fix():
    vocab = {k: v for k, v in VOCAB.items() if k != "<repo_name>"}
    with pytest.raises(ValueError, match="--mask-token"):
        choose_mask_token_id(_Tok(vocab), num_embeddings=5)


def test_mask_token_present_in_data_is_an_error():
    assert check_mask_token_absent(3, [torch.tensor([4, 5]), torch.tensor([1, 2])]) == 4
    with pytest.raises(ValueError, match="sample 1"):
        check_mask_token_absent(3, [torch.tensor([4, 5]), torch.tensor([1, 3])])


def test_each_forbidden_id_is_named_in_the_error():
    tok = _Tok(VOCAB, pad=0, eos=2, bos=1)
    for requested, name in ((0, "pad_token_id"), (2, "eos_token_id"), ("<|im_end|>", "eos_token_id"),
                            ("1", "bos_token_id")):
        with pytest.raises(ValueError, match=f"mask_token_id: .*equals the tokenizer's {name}.*reserved special token"):
            choose_mask_token_id(tok, num_embeddings=6, requested=requested)
    for bad in (-1, 6, "6"):
        with pytest.raises(ValueError, match=r"expected an id in \[0, 6\)"):
            choose_mask_token_id(tok, num_embeddings=6, requested=bad)
    assert choose_mask_token_id(tok, num_embeddings=6, requested="<repo_name>") == 3
    assert choose_mask_token_id(tok, num_embeddings=6, requested=5) == 5  # a real token: checked against the data


def test_draft_config_refuses_pad_eos_and_out_of_range():
    from deepspec.algorithms.dspark.config import DraftConfig

    base = dict(family="llama", hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                intermediate_size=16, max_position_embeddings=32, vocab_size=10, target_hidden_size=8,
                target_num_hidden_layers=3, target_layer_ids=[0, 1], num_draft_layers=1, pad_token_id=0,
                eos_token_ids=[1, 2])
    DraftConfig(mask_token_id=3, **base)
    for mask_id, expected in ((0, "pad_token_id"), (2, "not an eos id"), (10, r"\[0, 10\)"), (-1, r"\[0, 10\)")):
        with pytest.raises(ValueError, match=f"DraftConfig.mask_token_id: expected .*{expected}"):
            DraftConfig(mask_token_id=mask_id, **base)


def test_mask_token_in_data_message_names_the_fix():
    with pytest.raises(ValueError, match=r"mask_token_id 3 occurs in training sample 0.*--mask-token"):
        check_mask_token_absent(3, [torch.tensor([[3]])])
    assert check_mask_token_absent(3, []) == 0
