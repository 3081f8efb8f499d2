"""Ciphers: a generator of keyed substitution ciphers (Caesar, Atbash, Vigenère, and chains of
them); the model decrypts or encrypts a message given the rule and the key."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from tasks.synth.base import LevelParams, SynthTask, TaskInstance
from tasks.synth.vocabulary import WORDS

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def shift_letter(ch: str, k: int) -> str:
    return ALPHABET[(ALPHABET.index(ch) + k) % 26] if ch in ALPHABET else ch


def apply_cipher(step: dict[str, Any], text: str, decrypt: bool) -> str:
    """One cipher step on upper-case text; non-letters pass through (and do not use up the key)."""
    sign = -1 if decrypt else 1
    if step["kind"] == "caesar":
        return "".join(shift_letter(ch, sign * step["shift"]) for ch in text)
    if step["kind"] == "atbash":
        return "".join(ALPHABET[25 - ALPHABET.index(ch)] if ch in ALPHABET else ch for ch in text)
    key, out, i = step["key"], [], 0
    for ch in text:   # vigenere
        if ch in ALPHABET:
            out.append(shift_letter(ch, sign * ALPHABET.index(key[i % len(key)])))
            i += 1
        else:
            out.append(ch)
    return "".join(out)


def describe(step: dict[str, Any]) -> str:
    if step["kind"] == "caesar":
        return f"Caesar: shift every letter {step['shift']} places forward in the alphabet (Z wraps to A)"
    if step["kind"] == "atbash":
        return "Atbash: replace each letter by its mirror (A<->Z, B<->Y, ...)"
    return (f"Vigenère with key {step['key']}: shift the n-th letter forward by the alphabet index "
            f"(A=0) of the key's n-th letter, repeating the key; spaces do not use up the key")


def normalize_letters(text: str) -> str:
    return " ".join(re.sub(r"[^A-Z ]", " ", text.upper()).split())


@dataclass(frozen=True)
class CipherParams(LevelParams):
    words: int
    kinds: tuple[str, ...]    # the chain applied, in order, when encrypting
    key_length: int
    encrypt: bool             # ask to encrypt instead of decrypt


class Cipher(SynthTask):
    name = "cipher"
    family = "cipher"
    answer_example = "HELLO WORLD"
    levels = (
        CipherParams(1, ("caesar",), 0, False), CipherParams(3, ("caesar",), 0, True),
        CipherParams(3, ("atbash",), 0, False), CipherParams(3, ("vigenere",), 3, False),
        CipherParams(4, ("vigenere",), 5, True), CipherParams(4, ("caesar", "vigenere"), 4, False),
        CipherParams(5, ("atbash", "vigenere"), 6, False),
    )

    def build(self, rng: random.Random, p: CipherParams) -> tuple[str, str, dict[str, Any]]:
        plain = " ".join(rng.choice(WORDS) for _ in range(p.words)).upper()
        chain = []
        for kind in p.kinds:
            step: dict[str, Any] = {"kind": kind}
            if kind == "caesar":
                step["shift"] = rng.randint(1, 25)
            if kind == "vigenere":
                step["key"] = "".join(rng.choice(ALPHABET) for _ in range(p.key_length))
            chain.append(step)
        secret = plain
        for step in chain:
            secret = apply_cipher(step, secret, decrypt=False)
        rules = "\n".join(f"{i}. {describe(s)}" for i, s in enumerate(chain, 1))
        if p.encrypt:
            source, answer, verb = plain, secret, "Encrypt"
        else:
            source, answer, verb = secret, plain, "Decrypt"
        question = (f"Encryption applies these steps in order:\n{rules}\n{verb} this message:\n"
                    f"{source}\nGive the result in capital letters, keeping the spaces.")
        return question, answer, {"chain": chain, "encrypt": p.encrypt}

    def check(self, instance: TaskInstance, answer: str) -> float:
        return 1.0 if normalize_letters(answer) == instance.answer else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        gold = instance.answer
        i = rng.choice([k for k, ch in enumerate(gold) if ch in ALPHABET])
        return [gold[:i] + shift_letter(gold[i], rng.randint(1, 25)) + gold[i + 1:]]
