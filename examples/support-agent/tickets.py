"""What Pageturner's customers ask, and what the shop knows the right answer to be.

A :class:`Ticket` is one customer question of one of five kinds, about one order or one
book, with its **reference answer**: one sentence whose facts (order and refund ids,
carriers, dates, amounts, copies, quoted titles) are what a checker can verify. The
wording varies (a dozen phrasings per kind, greetings, sign-offs, the customer's name), so
that tickets about different orders read differently, as real ones do; the facts of an
answer never appear in another form than the reference's (``19.90 EUR``, ``2026-12-04``).

:data:`PARAPHRASES` are right answers worded otherwise: the same facts, nothing added.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from datetime import date, timedelta

from bookshop import FIRST_NAMES, LAST_NAMES, Order, Shop, eur

KINDS = ("status", "refund_lost", "refund_damaged", "total", "stock")
KIND_WEIGHTS = (35, 10, 10, 20, 25)
# The tools a right answer needs, in order, by kind (and, for stock, nothing else).
NEEDED = {
    "status": ("find_order", "track_parcel"),
    "refund_lost": ("find_order", "track_parcel", "refund_order"),
    "refund_damaged": ("find_order", "refund_order"),
    "total": ("find_order",),
    "stock": ("check_stock",),
}
# Which parcel status an order of each kind has.
_STATUS_FOR = {"refund_lost": ("lost",), "refund_damaged": ("delivered",)}

QUESTIONS = {
    "status": (
        "Where is my order {order}?",
        "This is {name}. Has order {order} arrived yet?",
        "Can you tell me when {order} will get here?",
        "I ordered some books ({order}) and wonder where they are.",
        "Any news on my parcel for order {order}?",
        "What's the delivery status of {order}?",
        "My order number is {order}. Is it still on the way?",
        "{name} here, checking on order {order}. When does it arrive?",
        "Could you track order {order} for me, please?",
        "Has {order} been delivered? I haven't seen it.",
        "I'm waiting for order {order}: has it shipped?",
        "When will my books from order {order} be delivered?",
    ),
    "refund_lost": (
        "My parcel for {order} never came. Can I get my money back?",
        "Order {order} seems to be lost. I'd like a refund.",
        "This is {name}: order {order} never arrived and tracking hasn't moved. Refund please.",
        "Could you refund {order}? I think the parcel went missing.",
        "I never received order {order}. Can you refund it if it's lost?",
        "The parcel for my order {order} is lost, I think. Please refund it.",
        "{name} here. Still no sign of order {order}; I want my money back.",
        "Please check order {order}; it never turned up and I'd like a refund.",
    ),
    "refund_damaged": (
        "The books in order {order} arrived damaged. Can I get a refund?",
        "Order {order} came with torn covers and a wet spine. Refund please.",
        "This is {name}. My delivery {order} was damaged in the post; I'd like my money back.",
        "Could you refund order {order}? Everything arrived water-damaged.",
        "{name} here: the box for {order} was crushed and the books are ruined. Refund?",
        "My order {order} arrived broken. Please refund it.",
        "I received {order} today but the books are damaged. Please refund.",
        "The parcel for order {order} was soaked and the books are unreadable. Refund, please.",
    ),
    "total": (
        "How much did I pay for order {order}?",
        "What was the total of {order}?",
        "This is {name}. Can you remind me what order {order} cost?",
        "I need the amount charged for order {order} for my records.",
        "What did order {order} come to, shipping included?",
        "{name} here: how much was {order} in total?",
        "Could you tell me the total for my order {order}?",
        "How much was I charged for {order}?",
    ),
    "stock": (
        "Do you have '{title}' in stock?",
        "Is '{title}' available right now?",
        "This is {name}. How many copies of '{title}' do you have?",
        "I'd like to buy '{title}'. Is it in stock, and what does it cost?",
        "Can I order '{title}' today?",
        "{name} here: any copies of '{title}' left?",
        "Is '{title}' by {author} in stock?",
        "When can I get '{title}'?",
        "Have you got '{title}'? How much is it?",
    ),
}
GREETINGS = ("", "", "Hi, ", "Hello, ", "Hi there. ", "Good morning. ", "Hey, ", "Dear support, ")
# Every question names its customer somewhere (a ticket system shows who wrote), so two
# customers' questions of one phrasing still read apart.
SIGN_OFFS = (
    " Thanks, {first}",
    " Cheers, {first}",
    " Best, {name}",
    " - {name}",
    " {name}",
    " Thank you. {name}",
    " Many thanks, {first} {last_initial}.",
)
SIGNED = (" Thanks!", " Thank you.", "", " Thanks a lot.")  # when the question names them
# Order questions often say what was in the parcel.
CONTEXTS = (
    " It was {book}.",
    " (I ordered {book}.)",
    " It's the one with {book}.",
    " The order was placed on {placed}.",
    "",
    "",
)
# The shop's reference wording, by kind and (for status and stock) by case.
REFERENCES = {
    "in transit": "Order {order} is in transit with {carrier}, expected on {date}.",
    "delivered": "Order {order} was delivered on {date}.",
    "refund_lost": "Order {order} was lost; refund {refund} of {amount} is on its way.",
    "refund_damaged": "Refund {refund} of {amount} for order {order} is on its way.",
    "total": "Order {order} came to {amount}.",
    "in stock": "Yes: {copies} copies of '{title}' are in stock at {price}.",
    "sold out": "'{title}' is out of stock until {date}.",
}
PARAPHRASES = {
    "in transit": (
        "Your order {order} is on its way with {carrier} and should arrive on {date}.",
        "{carrier} has order {order}; it is expected on {date}.",
        "Good news: order {order} travels with {carrier}, due on {date}.",
    ),
    "delivered": (
        "Your order {order} arrived on {date}.",
        "According to tracking, order {order} was delivered on {date}.",
        "Order {order} reached you on {date}.",
    ),
    "refund_lost": (
        "Sorry, order {order} got lost, so refund {refund} of {amount} has been issued.",
        "The parcel of order {order} is lost; you get {amount} back (refund {refund}).",
    ),
    "refund_damaged": (
        "Sorry about the damage: order {order} is refunded, {amount} (refund {refund}).",
        "You will get {amount} back for order {order}; the refund is {refund}.",
    ),
    "total": (
        "You paid {amount} for order {order}.",
        "The total of order {order} was {amount}, shipping included.",
    ),
    "in stock": (
        "We have {copies} copies of '{title}', at {price} each.",
        "'{title}' is in stock: {copies} copies at {price}.",
    ),
    "sold out": (
        "Sorry, '{title}' is sold out; it is back on {date}.",
        "We have no copies of '{title}' until {date}.",
    ),
}


@dataclass(frozen=True)
class Ticket:
    """One customer question and what the shop knows about it."""

    kind: str
    customer: str
    question: str
    case: str  # which reference wording applies: a status, a refund kind, stock or not
    facts: dict[str, str]  # the values the answer templates are filled with
    order_id: str | None = None
    title: str | None = None

    @property
    def reference(self) -> str:
        return REFERENCES[self.case].format(**self.facts)

    @property
    def stated_facts(self) -> tuple[str, ...]:
        """The values the reference states (what a right answer must say too)."""
        names = re.findall(r"\{(\w+)\}", REFERENCES[self.case])
        return tuple(self.facts[name] for name in names)

    @property
    def needed_tools(self) -> tuple[str, ...]:
        return NEEDED[self.kind]

    def paraphrase(self, rng: random.Random) -> str:
        return rng.choice(PARAPHRASES[self.case]).format(**self.facts)


def _fits(order: Order, day: date) -> bool:
    """Whether a customer could ask about ``order`` on ``day`` (within two weeks of its
    last news)."""
    placed, when = date.fromisoformat(order.placed_on), date.fromisoformat(order.parcel.date)
    if order.parcel.status == "in transit":
        return placed < day <= when
    return when <= day <= when + timedelta(days=14)


class TicketMaker:
    """Draws tickets from a shop: each order is asked about at most once."""

    def __init__(self, shop: Shop, rng: random.Random) -> None:
        self.shop = shop
        self.rng = rng
        self._unused = {status: [] for status in ("in transit", "delivered", "lost")}
        for order_id in shop.order_ids:
            order = shop.orders[order_id]
            self._unused[order.parcel.status].append(order)

    def next(self, day: date | None = None) -> Ticket:
        """A ticket written on ``day`` (when given, about an order that was placed by then
        and whose parcel's date fits: delivered or lost by then, still expected after)."""
        kind = self.rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
        if kind == "stock":
            return self._stock_ticket()
        statuses = _STATUS_FOR.get(kind, ("in transit", "delivered"))
        status = self.rng.choice(statuses)
        pool = self._unused[status]
        fits = [i for i, order in enumerate(pool) if day is None or _fits(order, day)]
        if not fits:
            raise ValueError(f"the shop has no unused {status} order left for a ticket on {day}")
        order = pool.pop(self.rng.choice(fits))
        return self._order_ticket(kind, order)

    def _order_ticket(self, kind: str, order: Order) -> Ticket:
        parcel = order.parcel
        case = parcel.status if kind == "status" else kind
        facts = {
            "order": order.order_id,
            "carrier": parcel.carrier,
            "date": parcel.date,
            "amount": eur(order.total_eur),
            "refund": self.shop.refund_id(order.order_id),
        }
        slots = {
            "order": order.order_id,
            "book": f"'{self.rng.choice(order.books)}'",
            "placed": order.placed_on,
        }
        question = self._question(kind, order.customer, slots)
        return Ticket(kind, order.customer, question, case, facts, order_id=order.order_id)

    def _stock_ticket(self) -> Ticket:
        book = self.shop.books[self.rng.choice(sorted(self.shop.books))]
        customer = f"{self.rng.choice(FIRST_NAMES)} {self.rng.choice(LAST_NAMES)}"
        case = "in stock" if book.in_stock else "sold out"
        facts = {
            "title": book.title,
            "copies": str(book.in_stock),
            "price": eur(book.price_eur),
            "date": book.restock_on or "",
        }
        slots = {"title": book.title, "author": book.author}
        question = self._question("stock", customer, slots)
        return Ticket("stock", customer, question, case, facts, title=book.title)

    def _question(self, kind: str, customer: str, slots: dict[str, str]) -> str:
        first, last = customer.split()
        names = {"name": customer, "first": first, "last_initial": last[0]}
        template = self.rng.choice(QUESTIONS[kind])
        body = template.format(**slots, **names)
        greeting = self.rng.choice(GREETINGS)
        lower = greeting.endswith(", ") and not body.startswith(("I ", "I'", customer))
        if lower:
            body = body[0].lower() + body[1:]
        context = self.rng.choice(CONTEXTS).format(**slots) if "book" in slots else ""
        endings = SIGNED if "{name}" in template else SIGN_OFFS
        return (greeting + body + context + self.rng.choice(endings).format(**names)).strip()
