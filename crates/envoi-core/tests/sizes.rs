//! The futures every dispatch moves stay small: a caller boxes or stores
//! them whole, so growth costs every message.

use envoi_core::stamp::ReceivedStamp;
use envoi_core::{Command, Envelope, Message, Messenger};

#[derive(Debug, Clone)]
struct Noop;
impl Message for Noop {
    const NAME: &'static str = "Noop";
}
impl Command for Noop {
    type Output = ();
    type Error = std::convert::Infallible;
}

#[test]
fn the_dispatch_and_receive_futures_stay_small() {
    let messenger = Messenger::builder()
        .command_handler(|_: Noop| async { Ok(()) })
        .build()
        .unwrap();
    let bus = messenger.bus();
    let dispatch = std::mem::size_of_val(&bus.dispatch(Envelope::new(Noop)));
    let receive =
        std::mem::size_of_val(&bus.receive(Envelope::new(Noop).with(ReceivedStamp::new("q"))));
    let typed = std::mem::size_of_val(&messenger.dispatcher().dispatch(Noop));
    println!("dispatch={dispatch} receive={receive} typed={typed}");
    assert!(
        dispatch <= 160,
        "the dispatch future grew to {dispatch} bytes"
    );
    assert!(
        typed <= 160,
        "the typed dispatch future grew to {typed} bytes"
    );
}
