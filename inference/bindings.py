"""Which key or mouse button holds each of the 11 game buttons: the config's
``controls.bindings`` (button name -> pygame key name or ``mouseN``) over the defaults, one home
for the window (pygame key codes) and the browser page (``KeyboardEvent.code`` names)."""
from __future__ import annotations

import string

from owl_wms.controls import BUTTONS

DEFAULT_BINDINGS = dict(zip(BUTTONS, ("w", "a", "s", "d", "left shift", "space", "r", "f", "e", "mouse1", "mouse3")))

# pygame key names -> the browser's KeyboardEvent.code (the physical key, as pygame's names are)
BROWSER_KEYS = {
    **{c: f"Key{c.upper()}" for c in string.ascii_lowercase}, **{d: f"Digit{d}" for d in string.digits},
    "space": "Space", "tab": "Tab", "return": "Enter", "backspace": "Backspace", "caps lock": "CapsLock",
    "left shift": "ShiftLeft", "right shift": "ShiftRight", "left ctrl": "ControlLeft", "right ctrl": "ControlRight",
    "left alt": "AltLeft", "right alt": "AltRight", "up": "ArrowUp", "down": "ArrowDown", "left": "ArrowLeft",
    "right": "ArrowRight", "insert": "Insert", "delete": "Delete", "home": "Home", "end": "End",
    "page up": "PageUp", "page down": "PageDown", "-": "Minus", "=": "Equal", "[": "BracketLeft",
    "]": "BracketRight", ";": "Semicolon", "'": "Quote", ",": "Comma", ".": "Period", "/": "Slash",
    "\\": "Backslash", "`": "Backquote",
    **{f"[{d}]": f"Numpad{d}" for d in string.digits},
}


def merged_bindings(bindings) -> dict[str, str]:
    """Every button's binding (lower-case name), the config's over the defaults."""
    bindings = dict(bindings or {})
    unknown = set(bindings) - set(DEFAULT_BINDINGS)
    if unknown:
        raise ValueError(f"controls.bindings has unknown buttons {sorted(unknown)}; the buttons are {list(BUTTONS)}")
    return {button: str(name).strip().lower() for button, name in {**DEFAULT_BINDINGS, **bindings}.items()}


def mouse_button(name: str) -> int | None:
    """N of a ``mouseN`` binding (pygame's numbering: 1 left, 2 middle, 3 right), else None."""
    return int(name[5:]) if name.startswith("mouse") and name[5:].isdigit() else None


def binding_tables(bindings, key_code, mouse_code=lambda button, n: n) -> tuple[dict, dict]:
    """(key code -> button index, mouse code -> button index) of the config's bindings, each code
    from ``key_code(button, name)`` or ``mouse_code(button, N)`` (for ``mouseN``); either raises
    ValueError naming a binding it has no code for. Two buttons on one key are refused."""
    keys, mouse = {}, {}
    for button, name in merged_bindings(bindings).items():
        n = mouse_button(name)
        table, code = (mouse, mouse_code(button, n)) if n is not None else (keys, key_code(button, name))
        if code in table:
            raise ValueError(f"controls.bindings: {name!r} is bound to both {BUTTONS[table[code]]} and {button}")
        table[code] = BUTTONS.index(button)
    return keys, mouse


def browser_bindings(bindings) -> dict:
    """{"keys": {KeyboardEvent.code: button index}, "mouse": {MouseEvent.button: button index}}
    of the config's bindings (Escape stays the browser's: it leaves pointer lock)."""

    def key_code(button, name):
        if name not in BROWSER_KEYS:
            raise ValueError(f"controls.bindings.{button}={name!r} has no browser key; the page knows "
                             f"letters, digits, {', '.join(repr(k) for k in list(BROWSER_KEYS)[36:48])} ...")
        return BROWSER_KEYS[name]

    def mouse_code(button, n):
        if not 1 <= n <= 5:
            raise ValueError(f"controls.bindings.{button}={f'mouse{n}'!r}: a browser has mouse1 to mouse5")
        return str(n - 1)  # the browser counts from 0: left, middle, right, back, forward

    keys, mouse = binding_tables(bindings, key_code, mouse_code)
    return {"keys": keys, "mouse": mouse}
