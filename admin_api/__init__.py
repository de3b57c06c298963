"""The admin HTTP API: a thin face over ``pspf.service`` for operators."""
