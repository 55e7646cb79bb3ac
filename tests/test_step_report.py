"""The session's step-report publisher (flows.step_report._BackgroundPublisher): a publish that does
not return (a Prefect API that stopped answering: its client retries each call for about a
minute) holds back the reports, never the steps."""
import threading

import flows.step_report as step_report


class _Ctx:
    """What the publisher reads of a step's context."""

    def __init__(self, step: int, interval_s: float = 0.0):
        self.step, self.interval_s = step, interval_s

    def get(self, key: str, default=None):
        assert key == "orchestration.step_report_interval_s"
        return self.interval_s


def test_a_publish_that_hangs_holds_back_reports_not_steps(monkeypatch):
    api_answers = threading.Event()
    published = []

    def publish_step(ctx, summaries):  # the two artifact calls, against an API that hangs
        published.append(ctx.step)
        api_answers.wait(60)

    monkeypatch.setattr(step_report, "publish_step", publish_step)
    publisher = step_report._BackgroundPublisher()
    publisher.submit(_Ctx(1), {})
    publisher.start()  # step 2's rollout is done: step 1's report starts, and hangs
    first = publisher.thread
    assert first is not None and first.is_alive()

    # the end of step 2 and of step 3, each in a thread of its own: a submit that waited for the
    # hung publish would still be running when it is looked at
    for step in (2, 3):
        step_end = threading.Thread(target=publisher.submit, args=(_Ctx(step), {}))
        step_end.start()
        step_end.join(10)
        assert not step_end.is_alive(), f"the end of step {step} waited for step 1's report"
        publisher.start()  # the next step's rollout is done: no second publish beside the hung one
        assert publisher.thread is first
    assert published == [1] and publisher.pending[1].step == 3  # step 2's report was replaced

    api_answers.set()  # the API answers again; the session's close publishes the last step
    publisher.wait(30)
    assert published == [1, 3] and publisher.pending is None and not publisher.running()
