"""What every stage's command line shares: the help formatter that shows each flag's default."""
import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and ends every flag's help with its default (unless it says it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        # None means "not given": the help text says what happens then, better than "(default: None)".
        if "default" in text.lower() or action.required or action.default in (None, argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"
