"""``openrlhf-div bandit`` (being written)."""


def add_parser(sub):
    p = sub.add_parser("bandit", help="the controlled 50-arm bandit (LAD Figure 1, DS Lemma B.5)")
    p.set_defaults(func=lambda a: (print("not implemented yet"), 1)[1])
    return p
