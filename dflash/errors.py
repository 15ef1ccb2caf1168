"""Errors caused by the user's input or configuration: reported as one clear line, no traceback."""


class UserError(ValueError):
    pass
