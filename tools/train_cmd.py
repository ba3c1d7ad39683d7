"""train: todo."""


def add_arguments(p):
    """x"""


def run(args):
    """x"""
    return 2
